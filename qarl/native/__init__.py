"""Native CPU GEMMs for decoding (AVX2 + FMA), batch-invariant by construction.

`available()` says whether they run here (`why_unavailable()` says why not). Weights are
packed once (`pack_f32`, `pack_s8`, `pack_u4`) and the packed object is reused for every call:

- `linear_f32(x, w)`: fp32 x W^T (+ bias) (+ residual), one fma chain per output element;
- `linear_s8(xq, xs, w)`: W8A8 int8, exact int32 sums, then (acc * xs) * ws, the same bits
  as `torch._int_mm` followed by the same two scale products; `linear_s8_dynamic(x, w)` also
  quantizes the rows of x (`quantize_rows_s8`, = `numerics.int8_rows` bit for bit);
- `linear_u4(x, w)`: int4 group weights dequantized to exactly `numerics.int4_dequantize`'s
  values, then the fp32 chain: equal to `linear_f32(x, pack_f32(dequantized))` bit for bit.

Tensors must be on the CPU; x is made contiguous. See README.md for the measured speed.
"""

from __future__ import annotations

from qarl.native.build import why_unavailable
from qarl.native.decode import (
    BlockGemm, GemmKind, DecodeBlock, attend_decode, decode_attention, rms_norm, sample_rows,
    silu_mul,
)
from qarl.native.ffi import available
from qarl.native.gemm import (
    NR, NR8, PackedF32, PackedS8, PackedU4, linear_f32, linear_s8, linear_s8_dynamic, linear_u4,
    pack_f32, pack_s8, pack_u4, quantize_rows_s8,
)

__all__ = [
    "available", "why_unavailable", "PackedF32", "PackedS8", "PackedU4",
    "pack_f32", "pack_s8", "pack_u4", "linear_f32", "linear_s8", "linear_s8_dynamic",
    "linear_u4", "quantize_rows_s8", "attend_decode", "decode_attention", "rms_norm", "silu_mul",
    "BlockGemm", "DecodeBlock", "sample_rows", "GemmKind", "NR", "NR8",
]
