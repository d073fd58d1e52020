"""qarl.native's int8 GEMM at the row and column counts where its tiles have edges (AMX's 16 x 16
tiles in pairs, the VNNI / AVX2 4-row tiles), its GEMM on codes quantized already, and the bf16
quantize-dequantize of a bf16 gradient pass: bit-level promises (torch.equal against an int64
reference or the torch ops).
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
