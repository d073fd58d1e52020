"""qarl.native: exactness, batch invariance and errors of the kernels (AVX2, and the AVX-512 /
VNNI variants where the CPU has them).

Every test here states a bit-level promise of kernels.c and checks it with torch.equal: the
int8 GEMM is the exact integer dot product, the int4 GEMM is the fp32 chain on the exactly
dequantized weight, and no row's bits depend on the other rows.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qarl import native as nat
from qarl.native.isa import cpu_flags, has_int8_dot
from qarl.quant import numerics as nm

pytestmark = pytest.mark.skipif(not nat.available(), reason=f"native kernels: {nat.why_unavailable()}")

# (K, N): SmolLM2 / 109M shapes, ragged N (not a multiple of 16 or 24), odd K, tiny
SHAPES = [(576, 192), (1536, 64), (1024, 72), (577, 50), (64, 24), (3, 5)]
ROWS = [1, 2, 3, 4, 5, 16, 17]


def _rand(shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _codes(shape, seed, low=-127):
    return torch.randint(low, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


def _rows_alone_equal(f, x, full):
    for i in sorted({0, x.shape[0] // 2, x.shape[0] - 1}):
        assert torch.equal(f(x[i:i + 1])[0], full[i]), i


def test_f32_matches_fp64_and_is_batch_invariant():
    """linear_f32 is x W^T within fp32 rounding of a K-term sum (|err| <= K * 2^-24 * sum|x w|,
    bounded here by 1e-6 * K * max(sum|x w|)), and every row alone has the bits it has in any batch."""
    for seed, (k, n) in enumerate(SHAPES):
        w = _rand((n, k), seed)
        packed = nat.pack_f32(w)
        for m in ROWS:
            x = _rand((m, k), 100 * seed + m, scale=2.0)
            y = nat.linear_f32(x, packed)
            ref = x.double() @ w.double().t()
            bound = 1e-6 * k * (x.double().abs() @ w.double().abs().t()).max()
            assert (y.double() - ref).abs().max() <= bound, (k, n, m)
            _rows_alone_equal(lambda r: nat.linear_f32(r, packed), x, y)


def test_f32_bias_and_residual_are_added_after_the_chain():
    """y = (x W^T + b) + r with the adds in that order: exactly the plain product followed by
    the two fp32 adds in torch (the epilogue never touches the chain's bits)."""
    k, n, m = 320, 96, 7
    w, x, b, r = _rand((n, k), 1), _rand((m, k), 2), _rand((n,), 3), _rand((m, n), 4)
    packed = nat.pack_f32(w)
    plain = nat.linear_f32(x, packed)
    assert torch.equal(nat.linear_f32(x, packed, b, r), (plain + b) + r)
    assert torch.equal(nat.linear_f32(x, packed, b), plain + b)
    lead = nat.linear_f32(x.view(1, m, k), packed, residual=r.view(1, m, n))
    assert lead.shape == (1, m, n) and torch.equal(lead[0], plain + r)


def test_f32_instruction_sets_give_the_same_bits():
    """The fp32 GEMM's AVX-512 tiles (8 rows, a zmm and a ymm per row) run the AVX2 tiles'
    chains: every output, with bias and residual, and the int4 GEMM built on them, has the
    same bits under each instruction set this CPU runs, at row counts around both tile
    heights (4 and 8). `f32_isa()` names the default: AVX-512 where the CPU has AVX-512F."""
    best = nat.f32_isa()
    rows = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33]
    outputs: dict[str, list[torch.Tensor]] = {}
    try:
        for isa in nat.F32_ISAS:
            if nat.use_f32_isa(isa) != isa:
                continue  # not on this CPU
            out = outputs.setdefault(isa, [])
            for seed, (k, n) in enumerate(SHAPES):
                w, b = _rand((n, k), seed), _rand((n,), seed + 1)
                packed = nat.pack_f32(w)
                for m in rows:
                    x, r = _rand((m, k), 100 * seed + m, scale=2.0), _rand((m, n), seed + m)
                    out += [nat.linear_f32(x, packed), nat.linear_f32(x, packed, b, r)]
            u, sc, z = nm.int4_groups(_rand((72, 576), 7), 64, False)
            packed = nat.pack_u4(u, sc, z, 64)
            out += [nat.linear_u4(_rand((m, 576), m).bfloat16().float(), packed) for m in rows]
    finally:
        nat.use_f32_isa(best)
    ran = list(outputs)
    assert ran[0] == "avx2" and ran[-1] == best, ran
    assert (best == "avx512") == ("avx512f" in cpu_flags()), best
    for isa in ran[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outputs["avx2"], outputs[isa])), isa


def test_s8_is_the_exact_integer_product_then_two_scale_products():
    """linear_s8_dynamic = float(sum_k q_x w_q) * s_x * s_w with (q_x, s_x) = int8_rows(x) and
    the int32 sum exact (int64 reference), including the extreme weight codes +-127 (every
    activation row has a +-127 code: its max), odd K and ragged N; each row alone has its bits
    in the batch."""
    for seed, (k, n) in enumerate(SHAPES + [(4096, 40)]):
        wq = _codes((n, k), seed)
        wq[0] = 127
        wq[-1, ::2] = -127
        ws = _rand((n,), seed + 1).abs() + 0.01
        packed = nat.pack_s8(wq, ws)
        for m in ROWS:
            x = _rand((m, k), 100 * seed + m, scale=3.0)
            xq, xs = nm.int8_rows(x)
            y = nat.linear_s8_dynamic(x, packed)
            acc = (xq.long() @ wq.long().t()).to(torch.int32)
            assert torch.equal(y, acc.float() * xs[:, None] * ws[None, :]), (k, n, m)
            _rows_alone_equal(lambda r: nat.linear_s8_dynamic(r, packed), x, y)


def test_s8_instruction_sets_give_the_same_bits():
    """Every int8 instruction set this CPU runs (AVX2 always; AVX-VNNI / AVX512-VNNI where it
    has them) gives the exact integer product's bits, alone and in a batch; `s8_isa()` names
    the one chosen by default, the best the CPU has."""
    best = nat.s8_isa()
    ran = []
    try:
        for isa in nat.S8_ISAS:
            if nat.use_s8_isa(isa) != isa:
                continue  # not on this CPU
            ran.append(isa)
            for seed, (k, n) in enumerate(SHAPES):
                wq, ws = _codes((n, k), seed), _rand((n,), seed + 1).abs() + 0.01
                packed = nat.pack_s8(wq, ws)
                for m in ROWS:
                    x = _rand((m, k), 100 * seed + m, scale=3.0)
                    xq, xs = nm.int8_rows(x)
                    acc = (xq.long() @ wq.long().t()).to(torch.int32)
                    y = nat.linear_s8_dynamic(x, packed)
                    assert torch.equal(y, acc.float() * xs[:, None] * ws[None, :]), (isa, k, n, m)
    finally:
        nat.use_s8_isa(best)
    assert ran[0] == "avx2" and ran[-1] == best, ran
    assert (best != "avx2") == has_int8_dot(), best


def test_s8_on_the_transposed_codes_is_the_exact_product_with_the_codes():
    """pack_s8_t(codes) packs codes^T, bit for bit what pack_s8 makes of the transpose written
    out with unit scales, for whole and ragged quads of rows and panels of columns; the GEMM on
    it is the exact integer product g_q codes [M, N] x [N, K] times the row scales, on every
    instruction set this CPU runs: the straight-through backward's dL/dx on the weight's
    codes. -128 is refused as by pack_s8."""
    best = nat.s8_isa()
    try:
        for seed, (k, n) in enumerate(SHAPES + [(16, 4), (17, 5)]):
            wq = _codes((n, k), seed)  # a layer's codes [N, K]
            packed = nat.pack_s8_t(wq)
            ref = nat.pack_s8(wq.t().contiguous(), torch.ones(k))
            assert torch.equal(packed.data, ref.data) and torch.equal(packed.scales, ref.scales)
            assert (packed.n, packed.k) == (k, n)
            for isa in nat.S8_ISAS:
                if nat.use_s8_isa(isa) != isa:
                    continue
                for m in (1, 5, 17):
                    gq, gs = nm.int8_rows(_rand((m, n), 10 * seed + m))
                    acc = (gq.long() @ wq.long()).to(torch.int32)
                    y = nat.linear_s8_codes(gq, gs, packed)
                    assert torch.equal(y, acc.float() * gs[:, None]), (isa, k, n, m)
    finally:
        nat.use_s8_isa(best)
    wq = _codes((8, 16), 0)
    wq[3, 3] = -128
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        nat.pack_s8_t(wq)


def test_quantizer_and_scaling_helpers_equal_the_torch_ops():
    """quantize_s8_rows = numerics.int8_rows and scale_s32(acc, xs, ws) = acc.float() * xs * ws,
    bit for bit, on rows with ties, zeros and int32 sums beyond 2^24 (rounded on conversion)."""
    x = _rand((33, 1537), 5, scale=4.0)
    x[1] = 0.0
    x[2, :4] = torch.tensor([127.0, 0.5, -1.5, 2.5])
    codes, scales = nat.quantize_s8_rows(x)
    ref_codes, ref_scales = nm.int8_rows(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    acc = torch.randint(-(2**30), 2**30, (33, 97), generator=torch.Generator().manual_seed(0),
                        dtype=torch.int32)
    xs, ws = _rand((33,), 1).abs(), _rand((97,), 2).abs()
    assert torch.equal(nat.scale_s32(acc, xs, ws), acc.float() * xs[:, None] * ws[None, :])
    assert torch.equal(nat.scale_s32(acc, xs), acc.float() * xs[:, None])
    # with per-column factors: the codes of x * cs, the product rounded once as torch's
    cs = _rand((1537,), 3).abs() + 0.01
    codes, scales = nat.quantize_s8_rows(x, cs)
    ref_codes, ref_scales = nm.int8_rows(x * cs)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    with pytest.raises(ValueError, match="col_scales"):
        nat.quantize_s8_rows(x, cs[:-1])


@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_u4_quantizer_equals_the_torch_ops(group, symmetric):
    """quantize_u4 = numerics.int4_groups + pack_nibbles (+ int4_dequantize) bit for bit:
    codes, bf16 scales and zeros, and the dequantized weight, on groups that are all zero,
    constant, hold exact ties (w / s = k + 1/2, rounded half to even) or saturate (the
    asymmetric group's min and max), for widths of several groups."""
    w = _rand((37, 4 * group), 7, scale=0.05)
    w[0, :group] = 0.0  # s = 0 -> 1, every code 8
    w[1, :group] = 0.01  # constant: max - min = 0 in the asymmetric format
    w[2, :8] = torch.tensor([7.5, -7.5, 3.5, 2.5, -0.5, 0.5, 1.5, -2.5]) * 2.0 ** -8
    u, s, z = nm.int4_groups(w, group, symmetric)
    codes, scales, zeros, deq = nat.quantize_u4(w, group, symmetric, dequantized=True)
    assert torch.equal(codes, nm.pack_nibbles(u)) and torch.equal(scales, s)
    assert (zeros is None) == symmetric and (symmetric or torch.equal(zeros, z))
    assert torch.equal(deq, nm.int4_dequantize(u, s, z, group))
    assert nat.quantize_u4(w, group, symmetric)[3] is None
    with pytest.raises(ValueError, match="multiple of group_size"):
        nat.quantize_u4(w[:, 1:], group, symmetric)


def test_s8_refuses_minus_128_weights():
    """A -128 weight code cannot take the activation's sign in int8: pack_s8 says so."""
    wq = _codes((8, 16), 0)
    wq[3, 3] = -128
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        nat.pack_s8(wq, torch.ones(8))


@pytest.mark.parametrize("group,symmetric", [(32, True), (64, False), (128, True), (64, True)])
def test_u4_equals_f32_on_the_dequantized_weight(group, symmetric):
    """linear_u4 equals linear_f32 on numerics.int4_dequantize's weight bit for bit, through
    both of its paths (1-2 rows from registers, more rows through a buffer)."""
    for seed, (k, n) in enumerate([(576, 192), (1536, 50), (1024, 72)]):
        if k % group:
            continue
        u, s, z = nm.int4_groups(_rand((n, k), seed), group, symmetric)
        packed = nat.pack_u4(u, s, z, group)
        dense = nat.pack_f32(nm.int4_dequantize(u, s, z, group))
        for m in ROWS:
            x = _rand((m, k), 10 * seed + m).bfloat16().float()
            y = nat.linear_u4(x, packed)
            assert torch.equal(y, nat.linear_f32(x, dense)), (k, n, m)
            _rows_alone_equal(lambda r: nat.linear_u4(r, packed), x, y)


def test_bad_inputs_raise_clearly():
    """Wrong dtypes, feature counts and group layouts name the problem."""
    packed = nat.pack_f32(_rand((8, 16), 0))
    with pytest.raises(ValueError, match="16 features"):
        nat.linear_f32(torch.zeros(2, 15), packed)
    with pytest.raises(ValueError, match="float32"):
        nat.linear_f32(torch.zeros(2, 16, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="group_size=64"):
        nat.pack_u4(torch.zeros(8, 96, dtype=torch.uint8), torch.ones(8, 1), None, 64)
    with pytest.raises(ValueError, match="16 features"):
        nat.linear_s8_dynamic(torch.zeros(3, 12), nat.pack_s8(_codes((8, 16), 2), torch.ones(8)))


def test_turned_off_by_environment(tmp_path):
    """QARL_NATIVE=0 makes the kernels unavailable, with the reason, and qarl falls back
    (to oneDNN's int8 GEMM on a CPU with VNNI or AMX, its exact fp32-GEMM emulation else)."""
    code = ("from qarl import native; from qarl.quant import SCHEMES; import torch;"
            "print(native.available(), native.why_unavailable());"
            "print(SCHEMES['w8a8-int8'].method(torch.device('cpu')))")
    env = {**os.environ, "QARL_NATIVE": "0", "QARL_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0] == "False turned off by QARL_NATIVE=0"
    expected = ("int_mm",) if has_int8_dot() else ("onednn", "sgemm")
    assert out.stdout.splitlines()[1] in expected


def test_built_once_per_source_into_qarl_home(tmp_path):
    """A fresh QARL_HOME gets one library named by the source hash, a build of another source
    (an older qarl) is dropped, and a second process reuses the library."""
    code = "from qarl import native; print(native.available())"
    env = {**os.environ, "QARL_HOME": str(tmp_path)}
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "qarl_cpu-0123456789abcdef.so").write_bytes(b"stale")
    env.pop("QARL_NATIVE", None)
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "True"
    built = sorted(p.name for p in (tmp_path / "kernels").iterdir())
    assert len(built) == 2 and built[0] == ".build.lock", built
    assert built[1].startswith("qarl_cpu-") and built[1].endswith(".so")


def _fake_compiler(tmp_path, fail_on: str = "", log=None, pause_s: float = 0.0):
    """A stand-in for gcc: answers --version, fails on the source named `fail_on`, else
    writes an empty output file; `log`: appends each call's arguments; pause_s: per call."""
    cc = tmp_path / "cc"
    cc.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fake-cc 1"; exit 0; fi\n'
        + (f'echo "$*" >> "{log}"\n' if log else "")
        + (f"sleep {pause_s}\n" if pause_s else "")
        + (f'for a in "$@"; do case "$a" in *{fail_on}) echo "{fail_on}:1: error: boom" >&2; '
           "exit 1;; esac; done\n" if fail_on else "")
        + 'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then : > "$2"; fi; shift; done\n')
    cc.chmod(0o755)
    return cc


_LOAD = "from qarl import native; print(native.available()); print(native.why_unavailable())"


def _load_with(cc, home) -> subprocess.Popen:
    env = {**os.environ, "QARL_HOME": str(home), "CC": str(cc)}
    env.pop("QARL_NATIVE", None)
    return subprocess.Popen([sys.executable, "-c", _LOAD], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_source_that_fails_to_compile_is_named_and_leaves_nothing(tmp_path):
    """A compiler that fails on one source: the kernels are unavailable, the reason names the
    file and the compiler's message, and the kernels folder holds no half-built library or
    object files (the sources compile as separate jobs, then link)."""
    home = tmp_path / "home"
    out, err = _load_with(_fake_compiler(tmp_path, fail_on="decode.c"), home).communicate()
    lines = out.splitlines()
    assert lines[0] == "False", err
    assert "building the kernels failed" in lines[1] and "(decode.c)" in out
    assert "boom" in out
    assert [p.name for p in (home / "kernels").iterdir()] == [".build.lock"]


def test_processes_started_together_build_the_kernels_once(tmp_path):
    """Two processes loading the kernels at once on an empty QARL_HOME: one compiles each
    source, the other waits for its library (the fake compiler's output is no library, so
    both then report that loading failed)."""
    log = tmp_path / "calls.txt"
    cc = _fake_compiler(tmp_path, log=log, pause_s=0.5)
    runs = [_load_with(cc, tmp_path / "home") for _ in range(2)]
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert out.splitlines()[0] == "False", err
    calls = log.read_text().splitlines()
    assert sum(" -c " in c and c.split(" -c ")[1].startswith(str(nat.build.SOURCES[0]))
               for c in calls) == 1, calls
    assert len(calls) == len(nat.build.SOURCES) + 1  # each source once, one link


def test_dynamic_int8_quantizer_equals_numerics():
    """The quantizer inside linear_s8_dynamic gives numerics.int8_rows' codes and scales bit for
    bit (the STE backward and fake mode use the torch one), including all-zero rows, exact .5
    ties and K % 8 != 0: through an identity weight of scale 1, output (m, j) is q_x[m, j] *
    s_x[m] exactly."""
    for k in (5, 64, 577, 1536):
        x = _rand((9, k), k, scale=4.0)
        x[1] = 0.0
        x[2, : min(k, 4)] = torch.tensor([127.0, 0.5, -1.5, 2.5])[: min(k, 4)]  # s = 1: ties
        ref_codes, ref_scales = nm.int8_rows(x)
        identity = nat.pack_s8(torch.eye(k, dtype=torch.int8), torch.ones(k))
        y = nat.linear_s8_dynamic(x, identity)
        assert torch.equal(y, ref_codes.float() * ref_scales[:, None]), k


def test_u4_bf16_rounding_equals_torch():
    """linear_u4(round_bf16=True) rounds x exactly as x.bfloat16().float() (ties to even,
    subnormals, infinities), so W4A16's kernel sees the act_qdq values of the learner."""
    u, s, z = nm.int4_groups(_rand((48, 64), 0), 32, False)
    packed = nat.pack_u4(u, s, z, 32)
    x = _rand((5, 64), 1, scale=3.0)
    x[0, :6] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 1e-40, float("inf"), 3.3e38])
    assert torch.equal(nat.linear_u4(x[1:], packed, round_bf16=True),
                       nat.linear_u4(x[1:].bfloat16().float(), packed))
    rounded = nat.linear_u4(x[:1], packed, round_bf16=True)
    reference = nat.linear_u4(x[:1].bfloat16().float(), packed)
    assert torch.equal(rounded.isnan(), reference.isnan())
    assert torch.equal(rounded.nan_to_num(), reference.nan_to_num())


def test_round_bf16_equals_torch_on_every_kind_of_value():
    """The vectorized rounding (8 lanes, then a scalar tail) gives x.bfloat16().float()'s bits
    for every non-NaN float (ties to even both ways, subnormals, values that round up to inf)
    and a NaN for every NaN, whatever lane the value falls in."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31, (100_003,), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    special = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 1e-40, -1e-40, 0.0, -0.0,
               float("inf"), -float("inf"), 3.3e38, -3.4e38, float("nan"), 2 ** -133]
    for offset in (0, 5, 100_003 - len(special)):  # vector lanes, and the scalar tail
        x[offset:offset + len(special)] = torch.tensor(special)
        rounded, reference = nat.round_bf16(x), x.bfloat16().float()
        nan = reference.isnan()
        assert torch.equal(rounded.isnan(), nan)
        assert torch.equal(rounded[~nan].view(torch.int32), reference[~nan].view(torch.int32))
    with pytest.raises(ValueError, match="float32 CPU"):
        nat.round_bf16(x.double())


def _attention_reference(qkv, H, Hkv, cos, sin, cache_k, cache_v, slot, mask, q_w, k_w, eps):
    # Attention.forward's math at T = 1 in PyTorch ops: norms, RoPE, cache write, SDPA
    import torch.nn.functional as F

    from qarl.model.decoder import apply_rope

    B, _, W = qkv.shape
    D = W // (H + 2 * Hkv)
    q, k, v = qkv.view(B, 1, H + 2 * Hkv, D).transpose(1, 2).split([H, Hkv, Hkv], dim=1)
    if q_w is not None:
        q = F.rms_norm(q, (D,), eps=eps) * q_w
        k = F.rms_norm(k, (D,), eps=eps) * k_w
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache_k[:, :, slot:slot + 1], cache_v[:, :, slot:slot + 1] = k, v
    m = None if mask is None else mask.bool()[:, None, None, :]
    out = F.scaled_dot_product_attention(q, cache_k[:, :, :slot + 1], cache_v[:, :, :slot + 1],
                                         attn_mask=m, enable_gqa=H != Hkv)
    return out.transpose(1, 2).reshape(B, 1, H * D), k


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_decode_attention_step_matches_pytorch(heads, qk_norm):
    """decode_attention (q/k norm, RoPE, cache write and attention of one new token, one call)
    equals the PyTorch ops it replaces: the rotated keys written into the cache bit for bit
    (RoPE is two rounded products and a sum in both; without a q/k norm), the values copied
    exactly, the output within 2e-6 (own softmax and summation order); other cache slots are
    untouched; a masked key gets no weight; grouped heads, and masks per sequence or shared
    by all, as the engine passes them."""
    H, Hkv = heads
    g = torch.Generator().manual_seed(H + qk_norm)
    B, S_max = 3, 24
    for D, slot in ((64, 0), (64, 17), (32, 9), (128, 23)):
        qkv = torch.randn(B, 1, (H + 2 * Hkv) * D, generator=g)
        angles = torch.rand(B, 1, 1, D // 2, generator=g) * 30
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        q_w, k_w = (torch.randn(D, generator=g), torch.randn(D, generator=g)) if qk_norm else (None, None)
        mask = (torch.rand(B, slot + 1, generator=g) > 0.3).to(torch.uint8)
        mask[:, -1] = 1
        for m, cs in ((mask, (cos, sin)), (mask[:1], (cos, sin)), (None, (cos[:1], sin[:1]))):
            ck, cv = torch.randn(2, B, Hkv, S_max, D, generator=g).unbind(0)
            rk, rv = ck.clone(), cv.clone()
            c, s = cs
            ref, ref_k = _attention_reference(qkv, H, Hkv, c, s, rk, rv, slot, m, q_w, k_w, 1e-6)
            out = nat.decode_attention(qkv, H, Hkv, c, s, ck, cv, slot, m, q_w, k_w, 1e-6)
            assert (out - ref).abs().max() < 2e-6, (D, slot)
            assert torch.equal(cv, rv)  # the value written at slot, every other slot untouched
            if qk_norm:  # the key went through a norm with its own summation order
                torch.testing.assert_close(ck, rk, atol=2e-6, rtol=0)
            else:
                assert torch.equal(ck, rk)
    poisoned = torch.randn(2, B, Hkv, S_max, D, generator=g)
    poisoned[1, :, :, 0] = float("nan")  # a masked slot's value must not leak in
    mask[:, 0] = 0
    out = nat.decode_attention(qkv, H, Hkv, cos, sin, poisoned[0], poisoned[1], slot, mask, q_w, k_w)
    assert not out.isnan().any()
    with pytest.raises(ValueError, match="room for the slot"):
        nat.decode_attention(qkv, H, Hkv, cos, sin, poisoned[0], poisoned[1], S_max, None)


def test_rms_norm_and_silu_mul_match_pytorch_and_are_row_exact():
    """rms_norm equals qarl's RMSNorm and silu_mul equals F.silu(gate) * up to a few ulp
    (their own summation order and exp), with or without a weight, on widths that are and are
    not multiples of the vector width; each row's bits do not depend on the other rows."""
    import torch.nn.functional as F

    from qarl.model.decoder import RMSNorm

    for n in (576, 64, 77, 3):
        x = _rand((9, 1, n), n, scale=3.0)
        norm = RMSNorm(n, 1e-6)
        norm.weight.data = _rand((n,), n + 1)
        with torch.no_grad():
            torch.testing.assert_close(nat.rms_norm(x, norm.weight, 1e-6), norm(x), atol=1e-5, rtol=1e-6)
        plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(nat.rms_norm(x, None, 1e-6), plain, atol=1e-6, rtol=1e-6)
        rows = x[:, 0]
        _rows_alone_equal(lambda r: nat.rms_norm(r, norm.weight, 1e-6), rows,
                          nat.rms_norm(rows, norm.weight, 1e-6))

        gate_up = _rand((9, 1, 2 * n), n + 2, scale=6.0)
        gate_up[0, 0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp over- and underflow
        ref = F.silu(gate_up[..., :n]) * gate_up[..., n:]
        torch.testing.assert_close(nat.silu_mul(gate_up), ref, atol=1e-5, rtol=1e-6)
        _rows_alone_equal(nat.silu_mul, gate_up[:, 0], nat.silu_mul(gate_up[:, 0]))


def _child(code: str, env: dict[str, str]) -> str:
    """`code`'s stdout in a fresh interpreter: allocator settings are process state a test must
    not leave behind, and torch reads THP_MEM_ALLOC_ENABLE once."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("QARL_MALLOC", "GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")} | env
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _allocator_in_child(env: dict[str, str]) -> str:
    return _child("from qarl.native.memory import allocator, tune_allocator\n"
                  "before = allocator(); first = tune_allocator(); again = tune_allocator()\n"
                  "assert before == 'untouched' and again == first, (before, first, again)\n"
                  "print(first)", env)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_allocator_tuned_once_per_process_and_opt_outs_respected():
    # in a child: the thresholds are process state this test must not leave behind
    assert _allocator_in_child({}) == "tuned"
    assert _allocator_in_child({"QARL_MALLOC": "default"}) == "glibc default (QARL_MALLOC=default)"
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}
    assert _allocator_in_child(tunables) == "as GLIBC_TUNABLES sets it"


# 3 x 400 MB freed at the heap's top: more than the 1 GiB trim threshold this module set
# before (and above glibc's default mmap threshold), so only a trim that is off keeps the pages
# for the next step. malloc itself: torch's aligned allocations reuse a freed block of the same
# size only when its neighbours allow, which is the heap's business, not the thresholds'.
_REUSE = """
import ctypes, resource
from qarl.native.memory import tune_allocator
print(tune_allocator())
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def step():
    blocks = [libc.malloc(400 << 20) for _ in range(3)]
    for b in blocks:
        libc.memset(b, 1, 400 << 20)  # every page touched
    for b in blocks:
        libc.free(b)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_tuned_allocator_keeps_freed_blocks_for_the_next_step():
    # 1.2 GB = 307k pages of 4 KiB: faulted in again when the heap is handed back
    tuned, faults = _child(_REUSE, {}).splitlines()
    assert tuned == "tuned" and int(faults) < 2000
    default, faults = _child(_REUSE, {"QARL_MALLOC": "default"}).splitlines()
    assert default.startswith("glibc default") and int(faults) > 250_000
    gib = "glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=1073741824"
    tunables, faults = _child(_REUSE, {"GLIBC_TUNABLES": gib}).splitlines()
    assert tunables == "as GLIBC_TUNABLES sets it" and int(faults) > 150_000


_HUGE = """
import qarl
qarl.ask_huge_pages()
from qarl.native.memory import huge_pages
state = huge_pages()
print(state)
if state == "on":
    import torch
    t = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    with open("/proc/self/smaps_rollup") as f:
        print(next(int(l.split()[1]) for l in f if l.startswith("AnonHugePages")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_huge_pages_asked_before_torch_and_opt_outs_named():
    out = _child(_HUGE, {}).splitlines()
    if out[0] == "on":  # the kernel backs the 64 MiB tensor with 2 MiB pages (some of them)
        assert int(out[1]) >= 2048, out
    else:
        assert out[0] == "off (kernel: transparent_hugepage never)", out
    assert _child(_HUGE, {"THP_MEM_ALLOC_ENABLE": "0"}) == "off (THP_MEM_ALLOC_ENABLE=0)"
    assert _child(_HUGE, {"QARL_MALLOC": "default"}) == "off (QARL_MALLOC=default)"
    late = _child("import torch\n" + _HUGE, {}).splitlines()
    assert late[0].startswith("off (not asked: call qarl.ask_huge_pages() before")
    assert _child("import qarl\nimport os\nprint(os.environ.get('THP_MEM_ALLOC_ENABLE'))",
                  {}) == "None"  # importing qarl changes nothing
    assert "huge_pages" in nat.machine()
