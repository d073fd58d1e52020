"""qarl.native's int8 GEMM at the row and column counts where its tiles have edges (AMX's 16 x 16
tiles in pairs, the VNNI / AVX2 4-row tiles), its GEMM on codes quantized already, the bf16
quantize-dequantize of a bf16 gradient pass, and the learner's one-pass token logprobs.

The int8 promises are bit-level (torch.equal against an int64 reference); the logprob kernel
sums in another order than torch's and is held to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from qarl import native as nat
from qarl.native.isa import has_amx_int8
from qarl.quant import SCHEMES
from qarl.quant import numerics as nm

pytestmark = pytest.mark.skipif(not nat.available(), reason=f"native kernels: {nat.why_unavailable()}")

# K a multiple of 64 runs AMX tiles; 80 and 577 do not (AMX CPUs run them on VNNI)
SHAPES = [(64, 16), (576, 48), (1536, 50), (576, 1536), (80, 33), (577, 17)]
ROWS = [1, 15, 16, 17, 31, 32, 33, 47, 64, 100]


def _rand(shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _codes(shape, seed):
    return torch.randint(-127, 128, shape, dtype=torch.int8,
                         generator=torch.Generator().manual_seed(seed))


def _each_isa():
    best = nat.s8_isa()
    try:
        for isa in nat.S8_ISAS:
            if nat.use_s8_isa(isa) == isa:
                yield isa
    finally:
        nat.use_s8_isa(best)


def test_s8_tiles_at_every_edge_give_the_exact_product():
    """Every instruction set this CPU runs gives the exact integer product's bits at row counts
    around 16 and 32 (AMX's tile and tile pair, partial blocks read from a padded copy) and
    column counts around 16 and 32 (one panel, a pair, a ragged last one)."""
    ran = []
    for isa in _each_isa():
        ran.append(isa)
        for seed, (k, n) in enumerate(SHAPES):
            wq, ws = _codes((n, k), seed), _rand((n,), seed + 1).abs() + 0.01
            packed = nat.pack_s8(wq, ws)
            x = _rand((max(ROWS), k), 10 + seed, scale=3.0)
            for m in ROWS:
                xq, xs = nm.int8_rows(x[:m])
                acc = (xq.long() @ wq.long().t()).to(torch.int32)
                want = acc.float() * xs[:, None] * ws[None, :]
                assert torch.equal(nat.linear_s8_dynamic(x[:m], packed), want), (isa, k, n, m)
    assert ("amx_int8" in ran) == (nat.s8_isa() == "amx_int8")


def test_amx_is_chosen_where_the_cpu_has_it():
    """On a CPU with AMX-INT8 (and a kernel that lets the process use it) the int8 GEMM runs
    on its tiles, W8A8 layers take qarl.native's kernel at every row count and say so."""
    if not has_amx_int8():
        pytest.skip("this CPU has no AMX-INT8")
    assert nat.s8_isa() == "amx_int8"
    scheme = SCHEMES["w8a8-int8"]
    cpu = torch.device("cpu")
    assert scheme.method(cpu) == "native" and scheme.native_rows(cpu) is None
    qw = scheme.quantize(_rand((64, 128), 0))
    assert "amx_int8" in scheme.kernel_path(cpu, qw)


def test_codes_gemm_equals_the_dynamic_one():
    """linear_s8_codes on numerics.int8_rows' codes gives linear_s8_dynamic's bits, on rows of
    K not a multiple of 4 (padded inside) and on a strided view of the codes."""
    for seed, (k, n) in enumerate([(576, 48), (577, 17), (64, 16)]):
        packed = nat.pack_s8(_codes((n, k), seed), _rand((n,), seed + 1).abs() + 0.01)
        x = _rand((40, k), seed, scale=2.0)
        xq, xs = nm.int8_rows(x)
        want = nat.linear_s8_dynamic(x, packed)
        assert torch.equal(nat.linear_s8_codes(xq, xs, packed), want), (k, n)
        wide = torch.zeros(40, k + 8, dtype=torch.int8)
        wide[:, :k] = xq
        assert torch.equal(nat.linear_s8_codes(wide[:, :k], xs, packed), want), (k, n)
    with pytest.raises(ValueError, match="int8 codes"):
        nat.linear_s8_codes(xq.float(), xs, packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qdq_to_bf16_equals_the_torch_ops(dtype):
    """qdq_s8_rows_bf16 = (q.float() * s).bfloat16() for (q, s) = int8_rows(x.float()), bit for
    bit, on rows with ties, zeros, one nonzero value and widths off the 8-lane vectors; W8A8's
    `act_qdq_to(x, bf16)` is it."""
    x = _rand((37, 1003), 4, scale=3.0)
    x[1] = 0.0
    x[2] = 0.0
    x[2, 5] = -2.0
    x[3, :4] = torch.tensor([127.0, 0.5, -1.5, 2.5])
    x = x.to(dtype)
    xq, xs = nm.int8_rows(x.float())
    want = (xq.float() * xs[:, None]).bfloat16()
    got = nat.qdq_s8_rows_bf16(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    scheme = SCHEMES["w8a8-int8"]
    assert torch.equal(scheme.act_qdq_to(x, torch.bfloat16).view(torch.int16), want.view(torch.int16))
    assert torch.equal(scheme.act_qdq_to(x, torch.float32), scheme.act_qdq(x.float()))


def test_weight_dequantized_to_bf16_equals_the_torch_ops():
    """dequant_s8_bf16 = (codes * scales[:, None]).bfloat16() bit for bit, over widths off the
    8-lane vectors and scales whose products land on bf16 ties; W8A8's dequantize_to is it."""
    codes = _codes((37, 1003), 8)
    scales = _rand((37,), 9).abs() + 0.01
    scales[0] = 1.0 + 2.0 ** -8  # q * s exactly halfway between bf16 neighbours for odd q
    want = (codes * scales[:, None]).bfloat16()
    got = nat.dequant_s8_bf16(codes, scales)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    qw = SCHEMES["w8a8-int8"].quantize(_rand((40, 96), 10))
    got = SCHEMES["w8a8-int8"].dequantize_to(qw, torch.bfloat16)
    assert torch.equal(got.view(torch.int16),
                       SCHEMES["w8a8-int8"].dequantize(qw).bfloat16().view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logp_matches_torch_and_its_gradient(dtype, temperature):
    """token_logp's logp, entropy and log-normalizer equal torch's log-softmax (of
    logits.float() / T) to fp32 rounding of a 1003-term sum, each row's bits are its own
    whatever the batch, and token_logp_backward is autograd's gradient of sum(g * logp), to
    one rounding in the logits' dtype."""
    z = _rand((37, 1003), 1, scale=4.0).to(dtype)
    tokens = torch.randint(0, 1003, (37,), generator=torch.Generator().manual_seed(2))
    logp, entropy, logz = nat.token_logp(z, tokens, temperature)
    scaled = z.float() / temperature
    log_soft = torch.log_softmax(scaled, -1)
    torch.testing.assert_close(logz, torch.logsumexp(scaled, -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(logp, log_soft.gather(-1, tokens[:, None])[:, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, -(log_soft.exp() * log_soft).sum(-1), rtol=0, atol=1e-5)
    alone = nat.token_logp(z[5:6], tokens[5:6], temperature)
    assert all(torch.equal(a[0], b[5]) for a, b in zip(alone, (logp, entropy, logz)))

    g = _rand((37,), 3)
    leaf = z.clone().requires_grad_(True)
    lp = (leaf.float() / temperature).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    (lp * g).sum().backward()
    grad = nat.token_logp_backward(z, tokens, temperature, logz, g)
    assert grad.dtype == dtype
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22  # relative, one rounding or two
    bound = ulp * leaf.grad.float().abs() + 1e-6
    assert ((grad.float() - leaf.grad.float()).abs() <= bound).all()


def test_learner_logprobs_take_the_native_kernel_with_the_same_values():
    """The learner's chunked logprobs (`qarl.train.learner.logprobs`) run on the native kernel on
    the CPU: the same logp and entropy as the PyTorch ops to fp32 rounding, and the same hidden-state
    gradient to bf16 rounding under a bf16 pass."""
    from torch import nn

    from qarl.train.learner import logprobs as lp

    torch.manual_seed(0)
    head = nn.Linear(64, 1000, bias=False)
    hidden = _rand((48, 64), 5, scale=2.0)
    tokens = torch.randint(0, 1000, (48,), generator=torch.Generator().manual_seed(6))
    results = {}
    for native in (True, False):
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if native:
                logp, entropy = lp._chunk_logprobs_and_entropy(head, h, tokens, 1.0)
            else:
                logits = lp.lm_head_logits(head, h)
                logp = lp.token_logprobs(logits, tokens, 1.0)
                ls = torch.log_softmax(logits.float(), -1)
                entropy = -(ls.exp() * ls).sum(-1)
        assert native == (logp.grad_fn.name() == "_NativeTokenLogpBackward")
        logp.sum().backward()
        results[native] = (logp.detach(), entropy.detach(), h.grad)
    (a_lp, a_ent, a_g), (b_lp, b_ent, b_g) = results[True], results[False]
    torch.testing.assert_close(a_lp, b_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(a_ent, b_ent, rtol=0, atol=1e-5)
    torch.testing.assert_close(a_g, b_g, rtol=2e-2, atol=1e-3)


def test_qdq_and_dequantize_in_fp32_equal_the_torch_ops():
    """qdq_s8_rows_f32 = q.float() * s for (q, s) = int8_rows(x), and dequant_s8_f32 = codes *
    scales[:, None], bit for bit, on rows with ties, zeros, one nonzero value and widths off
    the 8-lane vectors; W8A8's act_qdq and dequantize are them on the CPU."""
    x = _rand((37, 1003), 11, scale=3.0)
    x[1] = 0.0
    x[2] = 0.0
    x[2, 5] = -2.0
    x[3, :4] = torch.tensor([127.0, 0.5, -1.5, 2.5])
    xq, xs = nm.int8_rows(x)
    want = xq.float() * xs[:, None]
    assert torch.equal(nat.qdq_s8_rows_f32(x), want)
    assert torch.equal(nat.qdq_s8_rows_f32(x.reshape(37, 1, 1003)), want.reshape(37, 1, 1003))
    scheme = SCHEMES["w8a8-int8"]
    assert torch.equal(scheme.act_qdq(x), want)
    codes = _codes((37, 1003), 12)
    scales = _rand((37,), 13).abs() + 0.01
    assert torch.equal(nat.dequant_s8_f32(codes, scales), codes.float() * scales[:, None])
    qw = scheme.quantize(_rand((40, 96), 14))
    assert torch.equal(scheme.dequantize(qw), qw.codes.float() * qw.scales[:, None])
