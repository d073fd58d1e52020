"""Native CPU kernels for decoding and the learner's logprobs (AVX2 + FMA, AVX-512 / VNNI / AMX
variants chosen at run time), batch-invariant by construction; and `machine()`, what every
benchmark figure depends on.

`available()` says whether they run here (`why_unavailable()` says why not). Weights are
packed once (`pack_f32`, `pack_s8`, `pack_u4`; `pack_s8_t`, int8 codes transposed, for the
learner's input gradient) and the packed object is reused for every call:

- `linear_f32(x, w)`: fp32 x W^T (+ bias) (+ residual), one fma chain per output element;
- `linear_s8_dynamic(x, w)`: W8A8 int8 with the rows of x quantized per token in the kernel
  (= `numerics.int8_rows` bit for bit), exact int32 sums, then (acc * s_x) * s_w: the same
  bits as `torch._int_mm` followed by the same two scale products (`linear_s8_codes`: the
  same on rows quantized already);
- `linear_u4(x, w)`: int4 group weights dequantized to exactly `numerics.int4_dequantize`'s
  values, then the fp32 chain: equal to `linear_f32(x, pack_f32(dequantized))` bit for bit;
- `round_bf16(x)`: x.bfloat16().float() in one pass (the rounding of W4A16's rows).

For the learner, `token_logp` / `token_logp_backward`: the tokens' log-probabilities and the
entropy of lm_head logits in one pass per row, and their gradient.

Around the GEMMs, the per-token operations of a decode step: `decode_attention` (q/k norm, RoPE,
cache write and attention of one new token), `rms_norm`, `silu_mul`, `sample_rows`, and
`DecodeBlock`, a whole decoder block in one call, whose projections are `BlockGemm`s of a
`GemmKind` (the quantization scheme names the kind: `Scheme.native_operand`).

Tensors must be on the CPU; x is made contiguous. README.md here says how each kernel works;
benchmarks/quant_kernels.py (--parts int8, f32, blocks) measures their speed.
"""

from __future__ import annotations

import os

from qarl.native import isa
from qarl.native.build import why_unavailable
from qarl.native.decode import (
    BlockGemm, DecodeBlock, GemmKind, decode_attention, rms_norm, sample_rows, silu_mul,
)
from qarl.native.ffi import available
from qarl.native.gemm import (
    F32_ISAS, S8_ISAS, PackedF32, PackedS8, PackedU4, dequant_s8_bf16, dequant_s8_f32, f32_isa,
    linear_f32, linear_s8_codes, linear_s8_dynamic, linear_u4, pack_f32, pack_s8, pack_s8_t,
    pack_u4, qdq_s8_rows_bf16, qdq_s8_rows_f32, quantize_s8_rows, quantize_u4, round_bf16,
    s8_isa, scale_s32, use_f32_isa, use_s8_isa,
)
from qarl.native.logprobs import token_logp, token_logp_backward

__all__ = [
    "available", "why_unavailable", "PackedF32", "PackedS8", "PackedU4",
    "pack_f32", "pack_s8", "pack_s8_t", "pack_u4", "linear_f32", "linear_s8_dynamic",
    "linear_s8_codes",
    "linear_u4", "dequant_s8_bf16", "dequant_s8_f32", "qdq_s8_rows_bf16", "qdq_s8_rows_f32", "quantize_s8_rows", "quantize_u4", "round_bf16",
    "scale_s32", "S8_ISAS", "s8_isa", "use_s8_isa", "F32_ISAS", "f32_isa", "use_f32_isa",
    "decode_attention", "rms_norm", "silu_mul", "BlockGemm", "DecodeBlock", "GemmKind",
    "sample_rows", "token_logp", "token_logp_backward", "machine",
]


def machine() -> dict:
    """What a benchmark figure depends on: CPU name, ISA levels, cores, torch threads, what
    qarl.native.memory did to the allocator, and the instruction sets qarl.native's GEMMs run."""
    import torch

    from qarl.native.memory import allocator, huge_pages

    info = isa._cpuinfo()
    return {"cpu": isa.cpu_name(), "cpu_id": f"{info.get('vendor_id', '?')} family "
            f"{info.get('cpu family', '?')} model {info.get('model', '?')}",
            "isa": isa.isa_levels(), "cores": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "allocator": allocator(), "huge_pages": huge_pages(),
            # the instruction sets qarl.native's GEMMs dispatch to here (the same bits on each)
            "native_gemm": ({"f32": f32_isa(), "s8": s8_isa()} if available()
                            else f"off: {why_unavailable()}")}
