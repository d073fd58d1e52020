"""The learner's gradient-pass precision: `Precision`, resolved once at set-up from the recipe
(train.compute_dtype, train.quant_backward) and the machine (its fp32 GEMM library), held by
the learner and logged at the run's start.

The value of every logp the losses see comes from the exact replay (or the sampler), never
from the gradient pass (`logprobs.aligned_logprobs`), so the gradient pass may run in a
cheaper dtype without moving old_logp, the ratio or the trust band: under bfloat16 its forward
runs under `torch.autocast` and the straight-through backward of every QuantLinear
(`qarl.quant.linear`) multiplies in bf16 with fp32 results. Master weights and optimizer
state stay in model.master_dtype (float32), which is what lets small AdamW updates land:
bf16 master weights round an lr-2e-5 update away
(docs/learner.md#the-gradient-passs-precision).

In fp32 the same freedom lets the pass pick its GEMM library: on AMD CPUs with AVX-512, where
MKL runs its AVX2 code and oneDNN is the faster (`kernels.cpu_fp32_gemm`), `LearnerLinears`
routes the learner's plain linears through oneDNN and QuantLinear's backward takes
`kernels.learner_mm`; the gradient changes by fp32 summation order only.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from qarl.config import QuantSection, TrainSection
from qarl.native.isa import has_amx_bf16, has_bf16_math
from qarl.quant import SCHEMES, QuantLinear
from qarl.quant import kernels as K
from qarl.quant.codes import bf16_fast
from qarl.quant.linear import BACKWARDS


@dataclass(frozen=True)
class Precision:
    """What the learner's gradient pass computes in, decided once (`Precision.of`):
    `compute`, the dtype of its forward under grad (train.compute_dtype); `gemm`, the library
    of its fp32 GEMMs on the CPU ("onednn" or "mkl": `kernels.cpu_fp32_gemm`; None off the
    CPU); `quant_backward`, what its quantized layers' backward multiplies ("float" or
    "codes": train.quant_backward; None where the learner has no quantized layer);
    `requested`, the two recipe keys as written, for the log."""

    device: torch.device
    compute: torch.dtype
    gemm: str | None
    quant_backward: str | None
    scheme: str
    requested: tuple[str, str]  # (train.compute_dtype, train.quant_backward)

    @classmethod
    def of(cls, train: TrainSection, quant: QuantSection) -> Precision:
        """The precision of a learner of `quant` trained on train.device."""
        device = torch.device(train.device)
        compute = resolve_compute_dtype(train.compute_dtype, device)
        quantized = not SCHEMES[quant.scheme].is_identity and quant.align != "naive"
        backward = (resolve_quant_backward(train.quant_backward, quant.scheme, quant.align,
                                           device, compute) if quantized else None)
        return cls(device, compute, K.cpu_fp32_gemm(device), backward, quant.scheme,
                   (train.compute_dtype, train.quant_backward))

    def gradient_pass(self) -> ContextManager:
        """The context of the forward with grad (and of its recompute in backward)."""
        if self.compute != torch.float32:
            return torch.autocast(self.device.type, dtype=self.compute)
        return self.fp32_pass()

    def fp32_pass(self) -> ContextManager:
        """An fp32 pass on this machine's learner library: `LearnerLinears` where it is
        oneDNN, else nothing (torch's own GEMMs)."""
        return LearnerLinears() if self.gemm == "onednn" else nullcontext()

    def apply(self, model: nn.Module) -> None:
        """Every quantized layer of `model` takes `quant_backward`."""
        if self.quant_backward is not None:
            set_quant_backward(model, self.quant_backward)

    def describe(self) -> str:
        """The run's start line: what the gradient pass computes in, and why."""
        line = describe_compute(self.compute, self.requested[0], self.device)
        if self.quant_backward is None:
            return line
        return line + "; " + describe_quant_backward(self.quant_backward, self.requested[1],
                                                     self.scheme, self.device)


def resolve_compute_dtype(requested: str, device: torch.device) -> torch.dtype:
    """train.compute_dtype as a torch dtype on `device` ('auto': bf16 on CUDA and on CPUs with
    AMX-BF16, where a bf16 GEMM is much faster than an fp32 one; float32 on other CPUs, where a
    step gains little from bf16: with AVX512-BF16 alone the GEMMs are faster, but the forward,
    the straight-through backward's casts and attention are not GEMMs. Measured by
    benchmarks/step_time.py with train.compute_dtype as the arms' override;
    docs/learner.md#the-gradient-passs-precision)."""
    if requested == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and has_amx_bf16())
        return torch.bfloat16 if fast else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[requested]


def resolve_quant_backward(requested: str, scheme: str, align: str, device: torch.device,
                           compute: torch.dtype) -> str:
    """train.quant_backward as a QuantLinear.backward: 'auto' is 'codes' where the format's
    products on codes are the faster ones on `device` (`CodesPass.prefers`: int8 where its
    GEMM is torch._int_mm on VNNI or qarl.native's, W4A16's bf16 activations on a CPU with
    bf16 arithmetic) in a
    kernel-aligned learner with an fp32 gradient pass, 'float' elsewhere (a bf16 pass, the
    default on AMX CPUs and CUDA, already multiplies in bf16, faster than oneDNN's int8 GEMM
    there)."""
    if requested != "auto":
        return requested
    codes_pass = SCHEMES[scheme].codes_pass()
    codes = (align == "kernel" and compute == torch.float32 and codes_pass is not None
             and codes_pass.prefers(device))
    return "codes" if codes else "float"


def set_quant_backward(model: nn.Module, backward: str) -> int:
    """Every QuantLinear of `model` multiplies its backward as `backward` (of
    qarl.quant.linear.BACKWARDS) says; -> how many."""
    if backward not in BACKWARDS:
        raise ValueError(f"unknown QuantLinear backward {backward!r}; valid: {list(BACKWARDS)}")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for layer in layers:
        layer.backward = backward
    return len(layers)


def describe_quant_backward(backward: str, requested: str, scheme: str,
                            device: torch.device = torch.device("cpu")) -> str:
    """The run's start line's part on the quantized layers' backward."""
    if backward == "codes":
        grad_w = "bf16" if bf16_fast(device) else "fp32"
        grad_x = ("dL/dx by an int8 GEMM" if SCHEMES[scheme].codes_pass().grad_input_on_codes
                  else "dL/dx in float")
        what = f"on codes ({grad_x}, dL/dW in {grad_w} on the activations' codes)"
        if not SCHEMES[scheme].codes_pass().prefers(device):
            # e.g. int8 on a CPU without VNNI where qarl.native does not run: a reference path
            what += (", which this machine runs slowly (no instructions for it: 'auto' picks "
                     "the float backward here)")
    else:
        what = "on the dequantized weight and activations"
    return f"quantized layers' backward {what} (train.quant_backward = {requested!r})"


class _LearnerLinear(torch.autograd.Function):
    """y = x W^T (+ b) with its three GEMMs by oneDNN (`kernels.onednn_mm`): the gradient
    pass's fp32 linear on a CPU whose MKL is the slower library, an AMD CPU with AVX-512
    (`kernels.cpu_fp32_gemm` decides, and its comment says why). x [M, K] fp32, weight [N, K]
    fp32, bias [N] or None."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return K.onednn_mm(x, weight.t(), None if bias is None else bias.float())

    @staticmethod
    def backward(ctx, grad: Tensor):  # grad [M, N]
        x, weight = ctx.saved_tensors
        grad_x = K.onednn_mm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = K.onednn_mm(grad.t(), x) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def learner_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) of the gradient pass: `_LearnerLinear` for fp32 CPU operands
    where oneDNN is the learner's library, F.linear otherwise. x [..., K] -> [..., N]."""
    if x.dtype == weight.dtype == torch.float32 and K.cpu_fp32_gemm(x.device) == "onednn":
        y = _LearnerLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
        return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def lm_head_logits(lm_head: nn.Module, hidden: Tensor) -> Tensor:
    """lm_head(hidden), a plain nn.Linear through `learner_linear` under grad. Called inside
    the lm_head's activation checkpoint, whose recompute runs outside `LearnerLinears`: the
    explicit call gives forward and recompute the same autograd graph."""
    if type(lm_head) is nn.Linear and torch.is_grad_enabled():
        return learner_linear(hidden, lm_head.weight, lm_head.bias)
    return lm_head(hidden)


class LearnerLinears(TorchFunctionMode):
    """Within it, every F.linear (the plain nn.Linear layers of a learner: the whole model in
    `naive` alignment or full precision, the layers a scheme leaves unquantized) runs as
    `learner_linear`. QuantLinear's straight-through backward takes the same GEMMs itself
    (qarl.quant.linear)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return learner_linear(*args, **kwargs)
        return func(*args, **kwargs)


def describe_compute(dtype: torch.dtype, requested: str,
                     device: torch.device = torch.device("cpu")) -> str:
    """One line for the run's start: what the gradient pass computes in, and why."""
    name = str(dtype).removeprefix("torch.")
    library = K.cpu_fp32_gemm(device) if dtype == torch.float32 else None
    if library is not None:
        name += f", GEMMs by {'oneDNN' if library == 'onednn' else 'MKL'}"
    if requested != "auto":
        return f"{name} (train.compute_dtype = {requested!r})"
    if dtype == torch.bfloat16:
        why = "bf16 on CUDA" if device.type == "cuda" else "bf16 on a CPU with AMX-BF16"
    elif has_bf16_math():
        why = "fp32 on a CPU whose bf16 arithmetic has no AMX: bf16 gains little here"
    else:
        why = "fp32 on a CPU without bf16 arithmetic"
    return f"{name} (train.compute_dtype = 'auto': {why})"
