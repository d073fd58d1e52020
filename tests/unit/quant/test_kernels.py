"""Kernel paths: batch invariance, exactness of the integer/FP8 formulations, clear errors."""

from __future__ import annotations

import pytest
import torch

from qarl.quant import SCHEMES, batch_invariant_linear, make_scheme
from qarl.quant import kernels as K
from qarl.quant import numerics as nm

# (K, N): SmolLM2 shapes, a 128-multiple, a ragged K for block FP8, N % 16 != 0 (int4 fallback)
SHAPES = [(576, 192), (1536, 64), (256, 128), (320, 96), (128, 40)]
BATCHES = [1, 2, 7, 16, 17, 40]


def _rand(shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_linear_is_batch_invariant(name):
    """Row i of scheme.linear has the same bits alone and inside batches of any size, for many
    seeds and shapes (the engine decodes rows alone, the learner runs them all at once)."""
    scheme = SCHEMES[name]
    for seed, (k, n) in enumerate(SHAPES):
        if k % 64 and name in ("w4a16-int4", "w4a8-int"):
            continue
        qw = scheme.quantize(_rand((n, k), seed))
        bias = _rand((n,), seed + 100)
        for m in BATCHES:
            x = _rand((m, k), 1000 * seed + m, scale=3.0)
            full = scheme.linear(x, qw, bias)
            for i in sorted({0, m // 2, m - 1}):
                alone = scheme.linear(x[i:i + 1], qw, bias)
                assert torch.equal(alone[0], full[i]), (name, k, n, m, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_linear_positions(dtype):
    """batch_invariant_linear: every row of a 40-row batch equals the row computed alone."""
    w = _rand((96, 320), 0).to(dtype)
    x = _rand((40, 320), 1).to(dtype)
    full = batch_invariant_linear(x, w)
    for i in range(40):
        assert torch.equal(batch_invariant_linear(x[i:i + 1], w)[0], full[i])


def test_int8_sgemm_equals_int_mm():
    """The fp32-chunked int8 GEMMs (MKL and oneDNN-packed) give the same int32 as
    torch._int_mm (all exact), including K > 1024 (chunks) and the extreme codes +-127."""
    for k in (64, 1024, 1536, 2304):
        xq = torch.randint(-127, 128, (9, k), dtype=torch.int8, generator=torch.Generator().manual_seed(k))
        wq = torch.randint(-127, 128, (48, k), dtype=torch.int8, generator=torch.Generator().manual_seed(k + 1))
        xq[0], wq[0] = 127, 127  # worst-case magnitudes
        ref = K.exact_int8_gemm(xq, wq, "int_mm")
        assert torch.equal(K.exact_int8_gemm(xq, wq, "sgemm"), ref)
        if K.onednn_available(xq.device):
            assert torch.equal(K.exact_int8_gemm(xq, wq, "onednn"), ref)


def test_int8_gemm_choices_agree_through_the_scheme():
    """w8a8-int8 with gemm=int_mm, sgemm, native (where it runs) and the default produce
    identical outputs: the same exact int32 sums and the same two scale products."""
    w, x = _rand((64, 1536), 3), _rand((5, 1536), 4)
    a, b = make_scheme("w8a8-int8", gemm="int_mm"), make_scheme("w8a8-int8", gemm="sgemm")
    qw = a.quantize(w)
    assert torch.equal(a.linear(x, qw), b.linear(x, qw))
    assert torch.equal(a.linear(x, qw), SCHEMES["w8a8-int8"].linear(x, qw))
    if K.native_ok(x.device):
        assert torch.equal(a.linear(x, qw), make_scheme("w8a8-int8", gemm="native").linear(x, qw))


@pytest.mark.parametrize("name", ["w4a16-int4", "w4a8-int"])
def test_int4_gemm_choices(name):
    """The int4 kernels agree to the bf16 output rounding of int4pack (2^-8 relative), and the
    native one is exactly the native fp32 chain on act_qdq(x) and the dequantized weight."""
    w, x = _rand((48, 512), 5), _rand((6, 512), 6)
    packed = make_scheme(name, gemm="int4pack")
    qw = packed.quantize(w)
    ref = packed.linear(x, qw)
    if not K.native_ok(x.device):
        return
    nat_scheme = make_scheme(name, gemm="native")
    y = nat_scheme.linear(x, qw)
    assert ((y - ref).abs().max() / ref.abs().max()) < 2 ** -7
    if name == "w4a16-int4":
        from qarl import native
        dense = native.pack_f32(packed.dequantize(qw))
        assert torch.equal(y, native.linear_f32(packed.act_qdq(x), dense))


def test_fp8_emulation_is_the_exact_dot_product():
    """The fp64 FP8 GEMM equals an fp64 reference over the decoded E4M3 values (rounded once)."""
    xq, _ = nm.fp8_rows(_rand((6, 512), 5, scale=50.0))
    wq, _ = nm.fp8_rows(_rand((32, 512), 6))
    ref = (xq.double() @ wq.double().t()).float()
    assert torch.equal(K.exact_fp8_gemm(xq, wq.double()), ref)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_kernel_close_to_fake(name):
    """The kernel differs from F.linear(act_qdq(x), dequantize(qw)) only by matmul rounding:
    relative to the output scale, 1e-5 for fp32 paths and 1e-2 for the bf16-output int4pack
    kernel (bf16 keeps 8 significant bits: 2^-8 ~ 4e-3 per element)."""
    scheme = SCHEMES[name]
    w, x = _rand((128, 512), 7), _rand((11, 512), 8)
    qw = scheme.quantize(w)
    ref = torch.nn.functional.linear(scheme.act_qdq(x), scheme.dequantize(qw))
    err = (scheme.linear(x, qw) - ref).abs().max() / ref.abs().max()
    bf16_out = name in ("w4a16-int4", "w4a8-int") and not K.native_ok(x.device)
    assert err < (1e-2 if bf16_out else 1e-5)


def test_bad_dtype_and_device_raise():
    """Activations of an unsupported dtype or on a device without a path raise clearly."""
    scheme = SCHEMES["w8a8-int8"]
    qw = scheme.quantize(_rand((16, 64), 9))
    with pytest.raises(TypeError, match="float64"):
        scheme.linear(torch.zeros(2, 64, dtype=torch.float64), qw)
    with pytest.raises(ValueError, match="meta"):
        scheme.linear(torch.zeros(2, 64, device="meta"), qw)
    with pytest.raises(ValueError, match="features"):
        scheme.linear(torch.zeros(2, 32), qw)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_stacked_rows_give_each_layer_its_own_output(name):
    """stack_rows of q/k/v-like QWeights (one input, several layers) run as one linear equals
    the layers run one by one, bit for bit, for every row-separable format; the formats whose
    scales span rows (FP8-block tiles, NVFP4's global scale) are refused."""
    scheme = SCHEMES[name]
    separable = {"none", "w8a8-int8", "w8a8-fp8", "w4a16-int4", "w4a8-int"}
    assert scheme.row_separable == (name in separable)
    qws = [scheme.quantize(_rand((n, 256), seed)) for seed, n in enumerate((64, 32, 32))]
    if not scheme.row_separable:
        with pytest.raises(ValueError, match="not row-separable"):
            scheme.stack_rows(qws)
        return
    x = _rand((7, 256), 9, scale=3.0)
    stacked = scheme.linear(x, scheme.stack_rows(qws))
    assert torch.equal(stacked, torch.cat([scheme.linear(x, qw) for qw in qws], dim=-1))


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_bound_kernel_equals_linear(name):
    """Scheme.bound (the kernel with its choice and operands fixed once, what the engine's fused
    blocks call) gives scheme.linear's bits, with and without bias, for 3-D inputs."""
    from qarl.quant import run_rows

    scheme = SCHEMES[name]
    qw = scheme.quantize(_rand((48, 256), 11))
    x, bias = _rand((2, 3, 256), 12, scale=2.0), _rand((48,), 13)
    run = scheme.bound(qw, x.device)
    for b in (None, bias):
        assert torch.equal(run_rows(run, x, b, 48), scheme.linear(x, qw, b))
