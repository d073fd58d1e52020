"""Scheme: one object per format, the only home of what depends on the format.

A format is a frozen dataclass subclassing `Scheme` (its fields are its options, e.g. group
size) with a class attribute `name` (its SCHEMES key) and five methods (a sixth,
`quantize_dequantized`, has a default):
`quantize(w [N, K]) -> QWeight`; `dequantize(qw) -> [N, K] float32`; `act_qdq(x [M, K]) ->
[M, K] float32`, the activation quantizer followed by its dequantizer (what the kernel
effectively multiplies; `fake` mode and the straight-through backward use it);
`matmul(rows [M, K], qw) -> [M, N]`, the kernel on checked rows of a device it supports; and
`kernel_path(device, qw)`, the path and why it was chosen (for logs). The base class gives
`linear(x [..., K], qw, bias) -> [..., N]` in x's dtype around `matmul`.

What the engine asks of a format, with defaults that are always correct and optional
overrides that make it faster: `row_separable` (layers sharing an input may be stacked into
one QWeight, `stack_rows`, and run as one GEMM), `bound(qw, device)` (the kernel with its
choice and operands fixed once), `native_operand(qw, device)` (the qarl.native GEMM kind and
packed weight when `matmul` is one of them, so the one-call `qarl.native.DecodeBlock` can run
the layer), and `is_identity` (the format computes what the unquantized model computes).

Activations of the A16 formats are rounded to bfloat16 (the "16" of W4A16), whatever the
model dtype; the int8/fp8 activation formats quantize per token on the fly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from qarl import native as nat
from qarl.quant import kernels as K
from qarl.quant.codes import CodesPass
from qarl.quant.qweight import QWeight

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICES = ("cpu", "cuda")


def check_input(x: Tensor, scheme: str) -> None:
    if x.dtype in ACT_DTYPES and (x.is_cpu or x.is_cuda):
        return  # the common case, checked without building a device object
    if x.device.type not in DEVICES:
        raise ValueError(
            f"scheme {scheme!r} has no kernel path on device {x.device.type!r}; supported "
            f"devices: {list(DEVICES)}. Move the model to one of them."
        )
    if x.dtype not in ACT_DTYPES:
        raise TypeError(
            f"scheme {scheme!r} got activations of dtype {x.dtype}; supported: "
            f"{[str(d) for d in ACT_DTYPES]}. Cast the model (and inputs) to one of them."
        )


def run_rows(run, x: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """x [..., K] -> run(rows [M, K]) -> [M, N] (float32, or bf16 from the int4pack kernel),
    plus bias in float32, back in x's dtype and leading shape: [..., N]."""
    y = run(x.reshape(-1, x.shape[-1]))
    if bias is not None:
        y = y.float() + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


@dataclass(frozen=True)
class Scheme:
    """Base: shared input checks, flattening and bias; subclasses define the math (see the
    module doc for what a subclass defines and what it may override)."""

    name = "base"  # the SCHEMES key; also stored in every QWeight this scheme makes
    # Row n of the weight is quantized from row n alone (per-channel scales, or groups along
    # K): the layers that share an input can be stacked into one QWeight (`stack_rows`) and
    # run as one GEMM with exactly each layer's outputs.
    row_separable = False
    # The format leaves weights and activations as they are (full precision): a model under
    # it computes what the unquantized model computes.
    is_identity = False
    # One number of the format is set by the whole tensor (NVFP4's global scale): the layers
    # a serving engine fuses into one GEMM (q/k/v, gate/up) must share it, so `QuantLinear`
    # hands such a scheme the largest max|w| of its fused group (`quantize(w, group_amax)`).
    group_scaled = False

    def quantize(self, w: Tensor) -> QWeight:  # w [N, K] -> codes + scales
        raise NotImplementedError(f"{type(self).__name__} must define quantize")

    def dequantize(self, qw: QWeight) -> Tensor:  # -> [N, K] float32
        raise NotImplementedError(f"{type(self).__name__} must define dequantize")

    def act_qdq(self, x: Tensor) -> Tensor:  # [M, K] -> [M, K] float32
        raise NotImplementedError(f"{type(self).__name__} must define act_qdq")

    def dequantize_to(self, qw: QWeight, dtype: torch.dtype) -> Tensor:  # -> [N, K] dtype
        """dequantize(qw).to(dtype), bit for bit: a 16-bit gradient pass's W_hat. A format with
        a one-pass kernel for it overrides this."""
        return self.dequantize(qw).to(dtype)

    def act_qdq_to(self, x: Tensor, dtype: torch.dtype) -> Tensor:  # [M, K] -> [M, K] dtype
        """act_qdq(x.float()).to(dtype), bit for bit: a 16-bit gradient pass's x_hat. A format
        with a one-pass kernel for it overrides this."""
        return self.act_qdq(x.float()).to(dtype)

    def quantize_dequantized(self, w: Tensor, dequantized: bool = True
                             ) -> tuple[QWeight, Tensor | None]:
        """(quantize(w), dequantize of it or None): a learner layer needs both once per weight
        version; a format that computes the dequantized values on the way overrides this."""
        qw = self.quantize(w)
        return qw, self.dequantize(qw) if dequantized else None

    def matmul(self, x: Tensor, qw: QWeight) -> Tensor:  # [M, K] -> [M, N]
        raise NotImplementedError(f"{type(self).__name__} must define matmul")

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        raise NotImplementedError(f"{type(self).__name__} must define kernel_path")

    def options(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def linear(self, x: Tensor, qw: QWeight, bias: Tensor | None = None) -> Tensor:
        check_input(x, self.name)
        if x.shape[-1] != qw.shape[1]:
            raise ValueError(f"input has {x.shape[-1]} features, the {self.name} weight expects {qw.shape[1]}")
        return run_rows(lambda rows: self.matmul(rows, qw), x, bias, qw.shape[0])

    def bound(self, qw: QWeight, device: torch.device):
        """`rows [M, K] -> matmul(rows, qw)` for checked inputs on `device`, with the kernel
        choice and operand preparation done once: what the engine's fused blocks call at every
        decode step (`run_rows(scheme.bound(qw, d), x, bias, N) == scheme.linear(x, qw, bias)`
        bit for bit)."""
        return lambda rows: self.matmul(rows, qw)

    def native_operand(self, qw: QWeight, device: torch.device) -> tuple[nat.GemmKind, object] | None:
        """(native.GemmKind, packed weight) when this format's linear on `device` is one of qarl.native's
        GEMMs, in the form a `qarl.native.DecodeBlock` calls it (`qarl.native.BlockGemm`),
        computing exactly what `bound(qw, device)` computes; None otherwise."""
        return None

    def native_rows(self, device: torch.device) -> int | None:
        """Below how many rows the native operand is also the faster path (where another
        kernel computing the same bits wins on more rows); None: at any number of rows."""
        return None

    def prepared(self, qw: QWeight, device: torch.device, what: str, build) -> object:
        """Kernel-ready operand of `qw` for `device`, built once (layout only, never codes)."""
        key = (what, device)
        found = qw.prepared.get(key)
        if found is None:
            found = qw.prepared[key] = build()
        return found

    def codes_pass(self) -> CodesPass | None:
        """The format's gradient pass on codes (qarl.quant.codes), or None: a learner's layers
        keep x and multiply their backward in float."""
        return None

    def kernel_for_gradients(self, device: torch.device,
                             compute: torch.dtype = torch.float32) -> bool:
        """Whether a learner's gradient pass (kernel alignment, with grad) in `compute` (its
        dtype: train.compute_dtype resolved) runs this kernel, or F.linear on act_qdq(x) and
        the dequantized weight: the same function up to rounding, one dequantization per
        weight version (the backward needs it anyway) and a plain BLAS GEMM, where the kernel
        is an emulation or a decode-shaped one. The value of logp never comes from that pass
        (`qarl.train.learner.logprobs.aligned_logprobs`); only its gradient does. Default: the BLAS
        GEMM (int8 overrides: its GEMM is the faster in an fp32 pass)."""
        return False

    def float_gemm(self, x: Tensor, qw: QWeight, weight) -> Tensor:
        """x [M, K] . weight()^T with a batch-invariant GEMM: the native fp32 kernel on a CPU
        that runs it (weight packed once per QWeight), else `batch_invariant_linear`."""
        if self.native_f32_ok(x.device, qw):
            return nat.linear_f32(x.float(), self.native_f32(qw, x.device, weight))
        w = self.prepared(qw, x.device, "dequantized", weight)
        return K.batch_invariant_linear(x, w)

    def native_f32(self, qw: QWeight, device: torch.device, weight) -> nat.PackedF32:
        """weight() [N, K] float32 packed for qarl.native's fp32 GEMM, once per QWeight."""
        return self.prepared(qw, device, "native-f32", lambda: nat.pack_f32(weight()))

    def native_f32_ok(self, device: torch.device, qw: QWeight) -> bool:
        """qarl.native's fp32 GEMM runs `float_gemm` here: a CPU that runs it, and the fp32
        weight of a dequantizing format (a format whose weight may be in another dtype says
        so by overriding this)."""
        return K.native_ok(device)

    def float_gemm_path(self, device: torch.device, qw: QWeight) -> str:
        if self.native_f32_ok(device, qw):
            return f"native fp32 GEMM (qarl.native {nat.f32_isa()}, one fma chain per output)"
        return f"batch_invariant_linear ({K.BI_TILE}-row tiles)"

    def stack_rows(self, qws: list[QWeight]) -> QWeight:
        """The QWeights of layers that share an input (q/k/v, gate/up), stacked along the
        output dimension into one: [sum N_i, K]. Exact for a row-separable format: row n of
        the stack has the codes and scales it had in its layer, and the kernel computes it
        the same way. FP8-block (128x128 tiles across rows) and NVFP4 (one global scale per
        tensor) are not row-separable."""
        if not self.row_separable:
            raise ValueError(f"stack_rows: {self.name!r} is not row-separable; ask "
                             f"`scheme.row_separable` before stacking")
        first = qws[0]
        layout = lambda q: (q.scheme, q.shape[1], q.group_size, q.symmetric, q.codes.dtype)  # noqa: E731
        if first.scheme != self.name or any(layout(q) != layout(first) for q in qws):
            raise ValueError(f"stack_rows needs QWeights of {self.name!r} with one input size "
                             f"and layout; got {[layout(q) for q in qws]}")
        cat = lambda name: None if getattr(first, name) is None else torch.cat(  # noqa: E731
            [getattr(q, name) for q in qws])
        rows = sum(q.shape[0] for q in qws)
        return QWeight(first.scheme, (rows, first.shape[1]), cat("codes"), cat("scales"),
                       cat("zeros"), None, first.group_size, first.symmetric)

    def check_weight(self, w: Tensor) -> None:
        if w.dim() != 2:
            raise ValueError(f"{self.name}: expected a 2-D weight [out, in], got shape {tuple(w.shape)}")

    def matches(self, qw: QWeight) -> bool:
        return qw.scheme == self.name

