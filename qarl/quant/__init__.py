"""Quantization: formats, kernels, QuantLinear, and the learner -> engine weight export.

The method. QaRL's learner runs the same quantized computation as the rollout engine: the
same quantizer (codes, scales, rounding, group layout) and the same kernel. The master weights
stay in high precision and receive straight-through gradients; after each optimizer step every
layer is quantized once and its codes + scales (a QWeight) are pushed to the engine, which
uses them as-is. On CPU the learner's linear output equals the engine's bit for bit.

Formats (`SCHEMES[name]`; scale conventions follow vLLM compressed-tensors unless noted):
- `none`: full precision; linear is the batch-invariant fp32 GEMM.
- `w8a8-int8`: int8 weights, symmetric per output channel (s = max|w| / 127); activations
  int8 symmetric per token, scales computed on the fly (vLLM's dynamic per-token W8A8).
- `w8a8-fp8`: FP8 E4M3 weights per output channel (s = max|w| / 448) and dynamic per-token
  E4M3 activations (vLLM's FP8 "channel/token" scheme).
- `w8a8-fp8-block`: E4M3 with one scale per 128x128 weight tile and per 1x128 activation group
  (DeepSeek-V3, vLLM's block FP8); ragged edge tiles are allowed.
- `w4a16-int4`: int4 weights in groups along K (group_size 32/64/128, default 64 because
  SmolLM2's hidden size 576 is not a multiple of 128; symmetric default s = max|w| / 7.5 as in
  compressed-tensors, or asymmetric with a bf16 *float* zero, the tinygemm/HQQ convention:
  w = (u - 8) s + z); scales bf16; activations rounded to bf16.
- `w4a16-nvfp4`: E2M1 values, an E4M3 scale per 16 values, an fp32 global scale
  g = 448 * 6 / max|w| (compressed-tensors' `weight_global_scale`); bf16 activations.
- `w4a8-int`: the int4 group weights of w4a16-int4 with int8 per-token activations.
A new format is one `Scheme` subclass passed to `register_scheme` (see README.md).

Kernels (batch-invariant by construction or by test; `describe(model)` names each layer's):
CPU with `qarl.native` (AVX2 + FMA and a C compiler): int8 on its exact int8 GEMM; int4 and
w4a8 on its int4 GEMM; `none` (fp32 weights) and NVFP4 (dequantized) on its fp32 GEMM. CPU
without it: int8 as an exact fp32 GEMM on integer codes (oneDNN-packed, else MKL sgemm;
torch._int_mm gives the same bits); int4 via torch._weight_int4pack_mm_for_cpu; `none` and
NVFP4 via `batch_invariant_linear`. FP8 on CPU: an exact fp64 emulation. CUDA:
torch._scaled_mm for per-channel FP8 (capability >= 8.9), torch._int_mm for int8, emulation
otherwise.

API: `quantize_model(model, scheme, mode)` swaps nn.Linear for `QuantLinear` (modes fake /
kernel); `export_state(model)` -> {name: QWeight | Tensor}; `load_state(model, state)`;
`release_masters(model)` keeps only an engine copy's codes and scales; `describe(model)` names each layer's kernel path; `register_scheme` / `unregister_scheme`
add and remove a format.
"""

from qarl.quant.apply import (
    describe, export_state, load_state, quant_layers, quantize_model, release_masters,
)
from qarl.quant.kernels import batch_invariant_linear
from qarl.quant.linear import ALIGNS, MODES, QuantLinear
from qarl.quant.qweight import QWeight
from qarl.quant.scheme_base import run_rows
from qarl.quant.schemes import (
    SCHEMES, Scheme, make_scheme, register_scheme, scheme_options, unregister_scheme,
)

__all__ = [
    "ALIGNS", "MODES", "QWeight", "QuantLinear", "SCHEMES", "Scheme", "batch_invariant_linear",
    "describe", "export_state", "load_state", "make_scheme", "quant_layers", "quantize_model",
    "register_scheme", "release_masters", "run_rows", "scheme_options", "unregister_scheme",
]
