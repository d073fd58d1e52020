"""The gradient pass on codes: an optional capability of a format, `Scheme.codes_pass()`.

A learner's QuantLinear with grad keeps x for its straight-through backward and multiplies
dL/dx = g W_hat and dL/dW = g^T x_hat in float (qarl/quant/linear.py). A format whose kernel
takes its activations in a compact exact form can do better, and says how through a
`CodesPass` (None: the format has none, and the float backward is the only one):

- `forward_codes(x)`: the activation codes its kernel runs on, computed outside the kernel
  where that is as fast (W8A8 at 16+ rows through torch._int_mm, or on AMX tiles); the
  layer's forward then multiplies them (`matmul`), and its backward keeps them instead of x
  and builds x_hat from them (`x_hat`): the same x_hat without a second quantization, in a
  quarter of x's bytes. None: the kernel quantizes inside (the layer keeps x).
- With `QuantLinear.backward == "codes"` (recipe train.quant_backward): `keep(x)`, what a
  layer whose forward ran on no codes keeps of x for dL/dW (W4A16: bf16(x), its kernel's
  input); `grad_weight(g, codes)`, dL/dW on the kept codes; `grad_input(g, qw)`, dL/dx on
  the weight's codes where `grad_input_on_codes` (else dL/dx stays g W_hat in float).
- `prefers(device)`: whether train.quant_backward = 'auto' multiplies on codes on `device`
  (an fp32 gradient pass in kernel alignment): where these products are the faster ones.

Every product on codes equals the float one up to the rounding it names (tests/unit/quant/
test_linear.py); the value of logp never comes from the gradient pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from qarl.native.isa import has_bf16_math
from qarl.quant import kernels as K
from qarl.quant.qweight import QWeight


class CodesPass(Protocol):
    """A format's gradient pass on codes (module docstring). codes: a tuple of tensors."""

    grad_input_on_codes: bool  # dL/dx multiplies the weight's codes (`grad_input`)

    def prefers(self, device: torch.device) -> bool: ...

    def forward_codes(self, x: Tensor) -> tuple[Tensor, ...] | None: ...  # x [M, K] float32

    def matmul(self, codes: tuple[Tensor, ...], qw: QWeight) -> Tensor: ...  # -> [M, N]

    def keep(self, x: Tensor) -> tuple[Tensor, ...] | None: ...  # x [M, K] float32

    def x_hat(self, codes: tuple[Tensor, ...]) -> Tensor: ...  # -> [M, K] = act_qdq(x)

    def grad_weight(self, g: Tensor, codes: tuple[Tensor, ...]) -> Tensor: ...  # -> [N, K]

    def grad_input(self, g: Tensor, qw: QWeight) -> Tensor: ...  # -> [M, K] float32


def bf16_fast(device: torch.device) -> bool:
    """A bf16 GEMM runs faster than fp32 on `device`: CUDA, or a CPU with bf16 arithmetic."""
    return device.type == "cuda" or (device.type == "cpu" and has_bf16_math())


def codes_gemm(g: Tensor, codes: Tensor) -> Tensor:
    """g^T codes [N, K] float32 for g [M, N] float32 and activation codes [M, K] that bf16
    holds exactly (int8 codes, bf16 activations): in bf16 where `bf16_fast` (g's rounding is
    the one approximation), else fp32 (exact operands)."""
    dtype = torch.bfloat16 if bf16_fast(g.device) else torch.float32
    return K.learner_mm(g.to(dtype).t(), codes.to(dtype)).float()


@dataclass(frozen=True)
class Bf16ActivationCodes:
    """The pass on codes of a format whose kernel takes its activations rounded to bf16
    (W4A16, NVFP4): the layer keeps x_hat = bf16(x) itself, in half of x's bytes, and dL/dW
    is a bf16 GEMM of g with it where the CPU has bf16 arithmetic (the exact operand: g's
    bf16 rounding is the one approximation); dL/dx stays the float product with W_hat, whose
    group scales vary along both of its dimensions."""

    grad_input_on_codes = False

    def prefers(self, device: torch.device) -> bool:
        return device.type == "cpu" and has_bf16_math()

    def forward_codes(self, x: Tensor) -> None:
        return None  # the kernel rounds inside

    def matmul(self, codes: tuple[Tensor, ...], qw: QWeight) -> Tensor:
        raise NotImplementedError("bf16-activation formats run no forward on codes")

    def keep(self, x: Tensor) -> tuple[Tensor]:
        return (x.bfloat16(),)

    def x_hat(self, codes: tuple[Tensor]) -> Tensor:
        return codes[0].float()  # = act_qdq(x) bit for bit

    def grad_weight(self, g: Tensor, codes: tuple[Tensor]) -> Tensor:
        return codes_gemm(g.float(), codes[0])

    def grad_input(self, g: Tensor, qw: QWeight) -> Tensor:
        raise NotImplementedError("bf16-activation formats multiply dL/dx in float")
