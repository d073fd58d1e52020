"""Schemes: one object per format with quantize / dequantize / act_qdq / linear.

`quantize(w [N, K]) -> QWeight`; `dequantize(qw) -> [N, K] float32`; `act_qdq(x [M, K]) ->
[M, K] float32` is the activation quantizer followed by its dequantizer (what the kernel
effectively multiplies; `fake` mode and the straight-through backward use it);
`linear(x [..., K], qw, bias) -> [..., N]` in x's dtype runs the kernel path for x's device.
`kernel_path(device, qw)` names the path and why it was chosen (for logs).

Activations of the A16 formats are rounded to bfloat16 (the "16" of W4A16), whatever the
model dtype; the int8/fp8 activation formats quantize per token on the fly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from qarl import native as nat
from qarl.quant import kernels as K
from qarl.quant import numerics as nm
from qarl.quant.qweight import QWeight

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICES = ("cpu", "cuda")
INT4_GROUP_SIZES = (32, 64, 128)
INT8_GEMMS = ("auto", "int_mm", "native", "onednn", "sgemm")
INT4_GEMMS = ("auto", "int4pack", "native")
FP8_BLOCK = 128


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


@dataclass(frozen=True)
class Scheme:
    """Base: shared input checks, flattening and bias; subclasses define the math."""

    name = "base"

    def options(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def linear(self, x: Tensor, qw: QWeight, bias: Tensor | None = None) -> Tensor:
        check_input(x, self.name)
        lead, k = x.shape[:-1], x.shape[-1]
        if k != qw.shape[1]:
            raise ValueError(f"input has {k} features, the {self.name} weight expects {qw.shape[1]}")
        y = self._linear(x.reshape(-1, k), qw)  # [M, N] float32 (bf16 for the int4 kernel)
        if bias is not None:
            y = y.float() + bias.float()
        return y.to(x.dtype).reshape(*lead, qw.shape[0])

    def prepared(self, qw: QWeight, device: torch.device, what: str, build) -> object:
        """Kernel-ready operand of `qw` for `device`, built once (layout only, never codes)."""
        key = (what, device)
        found = qw.prepared.get(key)
        if found is None:
            found = qw.prepared[key] = build()
        return found

    def float_gemm(self, x: Tensor, qw: QWeight, weight) -> Tensor:
        """x [M, K] . weight()^T with a batch-invariant GEMM: the native fp32 kernel on a CPU
        that runs it (weight packed once per QWeight), else `batch_invariant_linear`."""
        if K.native_f32_ok(x.device, qw):
            packed = self.prepared(qw, x.device, "native-f32", lambda: nat.pack_f32(weight()))
            return nat.linear_f32(x.float(), packed)
        w = self.prepared(qw, x.device, "dequantized", weight)
        return K.batch_invariant_linear(x, w)

    def float_gemm_path(self, device: torch.device, qw: QWeight) -> str:
        if K.native_f32_ok(device, qw):
            return "native fp32 GEMM (qarl.native, one fma chain per output)"
        return f"batch_invariant_linear ({K.BI_TILE}-row tiles)"

    def check_weight(self, w: Tensor) -> None:
        if w.dim() != 2:
            raise ValueError(f"{self.name}: expected a 2-D weight [out, in], got shape {tuple(w.shape)}")

    def matches(self, qw: QWeight) -> bool:
        return qw.scheme == self.name


@dataclass(frozen=True)
class NoneScheme(Scheme):
    """Full precision. The QWeight holds a copy of the weight; linear is the batch-invariant GEMM."""

    name = "none"

    def quantize(self, w: Tensor) -> QWeight:
        self.check_weight(w)
        return QWeight(self.name, tuple(w.shape), w.detach().clone())

    def dequantize(self, qw: QWeight) -> Tensor:
        return qw.codes.float()

    def act_qdq(self, x: Tensor) -> Tensor:
        return x.float()

    def _linear(self, x: Tensor, qw: QWeight) -> Tensor:
        return self.float_gemm(x, qw, lambda: qw.codes)

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        return f"{self.float_gemm_path(device, qw)} in the weight's dtype: no quantization"


@dataclass(frozen=True)
class Int8Scheme(Scheme):
    """W8A8 int8: symmetric per-channel weights, dynamic symmetric per-token activations.
    gemm: "auto" (CPU: native if it runs here, else onednn, else sgemm; CUDA: int_mm),
    "native", "int_mm", "onednn" or "sgemm"; all give identical int32 accumulators and the
    same scale products, hence identical outputs (see kernels.exact_int8_gemm)."""

    gemm: str = "auto"
    name = "w8a8-int8"

    def __post_init__(self):
        if self.gemm not in INT8_GEMMS:
            raise ValueError(f"w8a8-int8 gemm={self.gemm!r}; valid: {sorted(INT8_GEMMS)}")

    def method(self, device: torch.device) -> str:
        if self.gemm != "auto":
            return self.gemm
        if device.type == "cuda":
            return "int_mm"
        if K.native_ok(device):
            return "native"
        return "onednn" if K.onednn_available(device) else "sgemm"

    def quantize(self, w: Tensor) -> QWeight:
        self.check_weight(w)
        codes, scales = nm.int8_rows(w.detach())
        return QWeight(self.name, tuple(w.shape), codes, scales)

    def dequantize(self, qw: QWeight) -> Tensor:
        return qw.codes.float() * qw.scales[:, None]

    def act_qdq(self, x: Tensor) -> Tensor:
        xq, xs = nm.int8_rows(x)
        return xq.float() * xs[:, None]

    def _linear(self, x: Tensor, qw: QWeight) -> Tensor:
        method = self.method(x.device)
        if method == "native":
            # int8_rows, the exact GEMM and (acc * s_x) * s_w, like the lines below, in one call
            packed = self.prepared(qw, x.device, "native-s8", lambda: nat.pack_s8(qw.codes, qw.scales))
            return nat.linear_s8_dynamic(x.float(), packed)
        xq, xs = nm.int8_rows(x)  # [M, K] int8, [M]
        chunks = None
        if method in ("sgemm", "onednn"):
            chunks = self.prepared(qw, x.device, method,
                                   lambda: K.int8_chunks(qw.codes, method == "onednn"))
        acc = K.exact_int8_gemm(xq, qw.codes, method, chunks)  # [M, N] int32, exact
        # y = (acc * s_x) * s_w
        return acc.float() * xs[:, None] * qw.scales[None, :]

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        method = self.method(device)
        if method == "native":
            return ("native int8 GEMM (qarl.native: AVX2 vpmaddubsw with the activation sign on "
                    "the weight, exact int32 sums = torch._int_mm bit for bit)")
        if method in ("sgemm", "onednn"):
            return (f"exact int8 GEMM as fp32 {method} on integer codes in K-chunks of 1024 "
                    "(= torch._int_mm bit for bit; _int_mm is slow on CPUs without VNNI)")
        return "torch._int_mm (exact int32 accumulation)"


@dataclass(frozen=True)
class Fp8Scheme(Scheme):
    """W8A8 FP8 E4M3: per-channel weight scales, dynamic per-token activation scales."""

    name = "w8a8-fp8"

    def quantize(self, w: Tensor) -> QWeight:
        self.check_weight(w)
        codes, scales = nm.fp8_rows(w.detach())
        return QWeight(self.name, tuple(w.shape), codes, scales)

    def dequantize(self, qw: QWeight) -> Tensor:
        return qw.codes.float() * qw.scales[:, None]

    def act_qdq(self, x: Tensor) -> Tensor:
        xq, xs = nm.fp8_rows(x)
        return xq.float() * xs[:, None]

    def _linear(self, x: Tensor, qw: QWeight) -> Tensor:
        xq, xs = nm.fp8_rows(x)  # [M, K] e4m3, [M]
        if K.cuda_fp8_supported(x.device, *qw.shape):
            return K.cuda_scaled_mm(xq, xs, qw.codes, qw.scales).float()
        w64 = self.prepared(qw, x.device, "float64_codes", lambda: qw.codes.double())
        # y = (sum_k xq wq, exact) * s_x * s_w
        return K.exact_fp8_gemm(xq, w64) * xs[:, None] * qw.scales[None, :]

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        if K.cuda_fp8_supported(device, *qw.shape):
            return "torch._scaled_mm, row-wise scales (CUDA capability >= 8.9, N and K % 16 == 0)"
        return "exact FP8 emulation: fp64 GEMM over E4M3 values (no fast FP8 kernel here)"


@dataclass(frozen=True)
class Fp8BlockScheme(Scheme):
    """W8A8 FP8 E4M3, DeepSeek-V3 blocks: 128x128 weight tiles, 1x128 activation groups."""

    name = "w8a8-fp8-block"

    def quantize(self, w: Tensor) -> QWeight:
        self.check_weight(w)
        codes, scales = nm.fp8_blocks(w.detach(), FP8_BLOCK, FP8_BLOCK)
        return QWeight(self.name, tuple(w.shape), codes, scales, group_size=FP8_BLOCK)

    def dequantize(self, qw: QWeight) -> Tensor:
        N, Kdim = qw.shape
        return qw.codes.float() * nm.expand_blocks(qw.scales, FP8_BLOCK, FP8_BLOCK, N, Kdim)

    def act_qdq(self, x: Tensor) -> Tensor:
        xq, xs = nm.fp8_blocks(x, 1, FP8_BLOCK)
        return xq.float() * nm.expand_blocks(xs, 1, FP8_BLOCK, *x.shape)

    def _weight_blocks(self, qw: QWeight) -> tuple[Tensor, Tensor]:
        N, Kdim = qw.shape
        kb = -(-Kdim // FP8_BLOCK)
        w = nm.pad_to(qw.codes.double(), N, kb * FP8_BLOCK).view(N, kb, FP8_BLOCK)
        blocks = w.permute(1, 2, 0).contiguous()  # [KB, 128, N]
        scales = qw.scales.repeat_interleave(FP8_BLOCK, 0)[:N].t().contiguous()  # [KB, N]
        return blocks, scales

    def _linear(self, x: Tensor, qw: QWeight) -> Tensor:
        xq, xs = nm.fp8_blocks(x, 1, FP8_BLOCK)  # [M, K] e4m3, [M, KB]
        blocks, scales = self.prepared(qw, x.device, "blocks", lambda: self._weight_blocks(qw))
        return K.exact_fp8_block_gemm(xq, xs, blocks, scales, FP8_BLOCK)

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        return ("exact block-FP8 emulation: fp64 per-128 partial sums, fixed-order fp32 "
                "scale promotion (no block-scaled FP8 kernel is wired)")


@dataclass(frozen=True)
class Int4Scheme(Scheme):
    """W4A16 int4: weights in groups of `group_size` along K, symmetric or with bf16 zeros;
    activations rounded to bf16. gemm: "auto" (CPU: native if it runs here, else int4pack),
    "native" (fp32 output, exactly the fp32 chain on the dequantized weight) or "int4pack"
    (torch._weight_int4pack_mm_for_cpu, bf16 output)."""

    group_size: int = 64
    symmetric: bool = True
    gemm: str = "auto"
    name = "w4a16-int4"

    def __post_init__(self):
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"{self.name} group_size={self.group_size}; valid: {list(INT4_GROUP_SIZES)}"
            )
        if self.gemm not in INT4_GEMMS:
            raise ValueError(f"{self.name} gemm={self.gemm!r}; valid: {sorted(INT4_GEMMS)}")

    def matches(self, qw: QWeight) -> bool:
        return (qw.scheme, qw.group_size, qw.symmetric) == (self.name, self.group_size, self.symmetric)

    def quantize(self, w: Tensor) -> QWeight:
        self.check_weight(w)
        u, s, z = nm.int4_groups(w.detach(), self.group_size, self.symmetric)
        return QWeight(self.name, tuple(w.shape), nm.pack_nibbles(u), s, z,
                       group_size=self.group_size, symmetric=self.symmetric)

    def dequantize(self, qw: QWeight) -> Tensor:
        return nm.int4_dequantize(nm.unpack_nibbles(qw.codes), qw.scales, qw.zeros, qw.group_size)

    def act_qdq(self, x: Tensor) -> Tensor:
        return x.bfloat16().float()

    def uses_native(self, device: torch.device) -> bool:
        if self.gemm == "native" and not K.native_ok(device):
            raise RuntimeError(
                f"{self.name} gemm='native' cannot run on {device.type}: "
                f"{K.native.why_unavailable() if device.type == 'cpu' else 'CPU only'}; "
                "use gemm='auto'"
            )
        return self.gemm == "native" or (self.gemm == "auto" and K.native_ok(device))

    def uses_kernel(self, device: torch.device, qw: QWeight) -> bool:
        return device.type == "cpu" and qw.shape[0] % 16 == 0

    def _pack(self, qw: QWeight) -> tuple[Tensor, Tensor]:
        return K.int4pack_prepare(nm.unpack_nibbles(qw.codes), qw.scales, qw.zeros)

    def _native(self, qw: QWeight, device) -> nat.PackedU4:
        return self.prepared(qw, device, "native-u4", lambda: nat.pack_u4(
            nm.unpack_nibbles(qw.codes), qw.scales, qw.zeros, qw.group_size))

    def _deq(self, qw: QWeight, device) -> Tensor:
        return self.prepared(qw, device, "dequantized", lambda: self.dequantize(qw))

    def _linear(self, x: Tensor, qw: QWeight) -> Tensor:
        if self.uses_native(x.device):
            # = the fp32 chain on act_qdq(x) (bf16 rounding done in the kernel, same bits) and
            # the dequantized weight, exactly
            return nat.linear_u4(x.float(), self._native(qw, x.device), round_bf16=True)
        if self.uses_kernel(x.device, qw):
            packed, sz = self.prepared(qw, x.device, "int4pack", lambda: self._pack(qw))
            return K.int4pack_mm(x.bfloat16(), packed, qw.group_size, sz)
        return K.batch_invariant_linear(self.act_qdq(x), self._deq(qw, x.device))

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        if self.uses_native(device):
            return ("native int4 GEMM (qarl.native: codes dequantized in registers to the exact "
                    "fp32 weight, fp32 fma chain), bf16-rounded activations")
        if self.uses_kernel(device, qw):
            return "torch._weight_int4pack_mm_for_cpu, bf16 activations"
        why = "N % 16 != 0" if device.type == "cpu" else "no int4 kernel wired for CUDA"
        return f"emulation: batch_invariant_linear on the dequantized weight ({why})"


@dataclass(frozen=True)
class W4A8Scheme(Int4Scheme):
    """W4A8: the int4 group weights of w4a16-int4, int8 per-token activations."""

    name = "w4a8-int"

    def act_qdq(self, x: Tensor) -> Tensor:
        xq, xs = nm.int8_rows(x)
        return xq.float() * xs[:, None]

    def _linear(self, x: Tensor, qw: QWeight) -> Tensor:
        xq, xs = nm.int8_rows(x)  # [M, K] int8, [M]
        if self.uses_native(x.device):
            y = nat.linear_u4(xq.float(), self._native(qw, x.device))  # codes exact in fp32
        elif self.uses_kernel(x.device, qw):
            packed, sz = self.prepared(qw, x.device, "int4pack", lambda: self._pack(qw))
            # int8 codes are exact in bf16 (|q| <= 127), so the int4 kernel sees them unchanged
            y = K.int4pack_mm(xq.bfloat16(), packed, qw.group_size, sz)
        else:
            y = K.batch_invariant_linear(xq.float(), self._deq(qw, x.device))
        # y = (sum_k q_x w_hat) * s_x
        return y.float() * xs[:, None]

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        if self.uses_native(device):
            return ("native int4 GEMM (qarl.native) on the int8 activation codes, per-token "
                    "scale after")
        if self.uses_kernel(device, qw):
            return ("torch._weight_int4pack_mm_for_cpu on int8 activation codes (exact in "
                    "bf16), per-token scale after (group scales cannot go through _int_mm)")
        return super().kernel_path(device, qw)


@dataclass(frozen=True)
class Nvfp4Scheme(Scheme):
    """W4A16 NVFP4: E2M1 values, E4M3 scale per 16, fp32 global scale; bf16 activations."""

    name = "w4a16-nvfp4"

    def quantize(self, w: Tensor) -> QWeight:
        self.check_weight(w)
        codes, s, g = nm.nvfp4(w.detach())
        return QWeight(self.name, tuple(w.shape), nm.pack_nibbles(codes), s, global_scale=g, group_size=16)

    def dequantize(self, qw: QWeight) -> Tensor:
        return nm.nvfp4_dequantize(nm.unpack_nibbles(qw.codes), qw.scales, qw.global_scale)

    def act_qdq(self, x: Tensor) -> Tensor:
        return x.bfloat16().float()

    def _linear(self, x: Tensor, qw: QWeight) -> Tensor:
        return self.float_gemm(self.act_qdq(x), qw, lambda: self.dequantize(qw))

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        return (f"emulation: {self.float_gemm_path(device, qw)} on the dequantized fp32 weight "
                "(no FP4 kernel here)")


class _Registry(dict):
    def __missing__(self, key):
        raise KeyError(f"unknown quantization scheme {key!r}; valid: {sorted(self)}")


SCHEMES: dict[str, Scheme] = _Registry({
    "none": NoneScheme(),
    "w8a8-int8": Int8Scheme(),
    "w8a8-fp8": Fp8Scheme(),
    "w8a8-fp8-block": Fp8BlockScheme(),
    "w4a16-int4": Int4Scheme(),
    "w4a16-nvfp4": Nvfp4Scheme(),
    "w4a8-int": W4A8Scheme(),
})


def make_scheme(name: str | Scheme, **options) -> Scheme:
    """SCHEMES[name] with `options` (e.g. group_size=128, symmetric=False) replacing defaults."""
    if isinstance(name, Scheme):
        base = name
    else:
        base = SCHEMES[name]
    valid = base.options()
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"scheme {base.name!r} has no option(s) {unknown}; valid: {sorted(valid)}")
    return type(base)(**{**valid, **options}) if options else base


def scheme_options(name: str) -> dict:
    """{option: default} that make_scheme(name, **options) accepts (for config validation)."""
    return SCHEMES[name].options()


def scheme_of(qw: QWeight) -> Scheme:
    """The scheme that reads `qw` (options taken from its layout)."""
    base = SCHEMES[qw.scheme]
    if isinstance(base, Int4Scheme):
        return make_scheme(qw.scheme, group_size=qw.group_size, symmetric=qw.symmetric)
    return base
