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
  compressed-tensors, or asymmetric with a bf16 *float* zero, the tinygemm/HQQ convention the
  CPU kernel computes: w = (u - 8) s + z); scales bf16; activations rounded to bf16.
- `w4a16-nvfp4`: E2M1 values, an E4M3 scale per 16 values, an fp32 global scale
  g = 448 * 6 / max|w| (compressed-tensors' `weight_global_scale`); bf16 activations.
- `w4a8-int`: the int4 group weights of w4a16-int4 with int8 per-token activations.

Kernels (batch-invariant by construction or measurement, see kernels.py and README.md):
CPU: int8 via an exact integer GEMM (fp32 sgemm on integer codes, bit-identical to
torch._int_mm which is also available); int4 via torch._weight_int4pack_mm_for_cpu; FP8 via an
exact fp64 emulation; NVFP4 and `none` via `batch_invariant_linear`. CUDA: torch._scaled_mm
for per-channel FP8 (capability >= 8.9), torch._int_mm for int8, emulation otherwise.

API: `quantize_model(model, scheme, mode)` swaps nn.Linear for `QuantLinear` (modes none /
fake / kernel); `export_state(model)` -> {name: QWeight | Tensor}; `load_state(model, state)`;
`describe(model)` names each layer's kernel path.
"""

from qarl.quant.apply import (
    DEFAULT_INCLUDE, describe, export_state, load_state, quant_layers, quantize_model, set_mode,
)
from qarl.quant.kernels import batch_invariant_linear
from qarl.quant.linear import MODES, QuantLinear
from qarl.quant.qweight import QWeight
from qarl.quant.scheme_base import run_rows
from qarl.quant.schemes import SCHEMES, Scheme, make_scheme, scheme_of, scheme_options

__all__ = [
    "DEFAULT_INCLUDE", "MODES", "QWeight", "QuantLinear", "SCHEMES", "Scheme",
    "batch_invariant_linear", "describe", "export_state", "load_state", "make_scheme",
    "quant_layers", "quantize_model", "run_rows", "scheme_of", "scheme_options", "set_mode",
]
