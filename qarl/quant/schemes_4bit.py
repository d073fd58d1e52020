"""The 4-bit formats: int4 groups with bf16 activations (W4A16), the same weights with int8
activations (W4A8), and NVFP4. The contract is the one of `scheme_base.Scheme`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qarl import native as nat
from qarl.quant import kernels as K
from qarl.quant import numerics as nm
from qarl.quant.qweight import QWeight
from qarl.quant.codes import Bf16ActivationCodes
from qarl.quant.scheme_base import Scheme


@dataclass(frozen=True)
class Int4Scheme(Scheme):
    """W4A16 int4: weights in groups of `group_size` along K, symmetric or with bf16 zeros;
    activations rounded to bf16. gemm: "auto" (CPU: native if it runs here, else int4pack),
    "native" (fp32 output, exactly the fp32 chain on the dequantized weight) or "int4pack"
    (torch._weight_int4pack_mm_for_cpu, bf16 output).
    QWeight: codes [N, K/2] uint8 (two unsigned nibbles, low first, u = q + 8); scales
    [N, K/g] bfloat16; zeros [N, K/g] bfloat16 if asymmetric (w = (u - 8) s + z)."""

    group_size: int = 64
    symmetric: bool = True
    gemm: str = "auto"
    name = "w4a16-int4"
    row_separable = True
    GROUP_SIZES = (32, 64, 128)
    GEMMS = ("auto", "int4pack", "native")

    def __post_init__(self):
        if self.group_size not in self.GROUP_SIZES:
            raise ValueError(
                f"{self.name} group_size={self.group_size}; valid: {list(self.GROUP_SIZES)}"
            )
        if self.gemm not in self.GEMMS:
            raise ValueError(f"{self.name} gemm={self.gemm!r}; valid: {sorted(self.GEMMS)}")

    def matches(self, qw: QWeight) -> bool:
        return (qw.scheme, qw.group_size, qw.symmetric) == (self.name, self.group_size, self.symmetric)

    def quantize(self, w: Tensor) -> QWeight:
        return self.quantize_dequantized(w, dequantized=False)[0]

    def quantize_dequantized(self, w: Tensor, dequantized: bool = True
                             ) -> tuple[QWeight, Tensor | None]:
        """One pass of qarl.native (codes, scales and the dequantized weight, the same bits
        as the torch ops) for an fp32 CPU weight where it runs; else the torch ops."""
        self.check_weight(w)
        w = w.detach()
        if w.dtype == torch.float32 and K.native_ok(w.device):
            nm.check_groups(w.shape[1], self.group_size, "int4 weight")
            codes, s, z, deq = nat.quantize_u4(w, self.group_size, self.symmetric, dequantized)
        else:
            u, s, z = nm.int4_groups(w, self.group_size, self.symmetric)
            codes = nm.pack_nibbles(u)
            deq = nm.int4_dequantize(u, s, z, self.group_size) if dequantized else None
        qw = QWeight(self.name, tuple(w.shape), codes, s, z, group_size=self.group_size,
                     symmetric=self.symmetric)
        return qw, deq

    def dequantize(self, qw: QWeight) -> Tensor:
        return nm.int4_dequantize(nm.unpack_nibbles(qw.codes), qw.scales, qw.zeros, qw.group_size)

    def act_qdq(self, x: Tensor) -> Tensor:
        return x.bfloat16().float()

    def codes_pass(self) -> Bf16ActivationCodes | None:
        return Bf16ActivationCodes()

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

    def _native_run(self, packed: nat.PackedU4):
        # rows -> the fp32 chain on act_qdq(rows) (bf16 rounding done in the kernel, same bits)
        # and the dequantized weight, exactly
        return lambda rows: nat.linear_u4(rows.float(), packed, round_bf16=True)

    native_kind = nat.GemmKind.U4_BF16  # what _native_run computes, as a DecodeBlock GEMM

    def native_operand(self, qw: QWeight, device: torch.device) -> tuple[nat.GemmKind, object] | None:
        return (self.native_kind, self._native(qw, device)) if self.uses_native(device) else None

    def bound(self, qw: QWeight, device: torch.device):
        if self.uses_native(device):
            return self._native_run(self._native(qw, device))
        return super().bound(qw, device)

    def matmul(self, x: Tensor, qw: QWeight) -> Tensor:
        if self.uses_native(x.device):
            return self.bound(qw, x.device)(x)
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
    """W4A8: the int4 group weights of w4a16-int4 (the same QWeight layout), int8 per-token
    activations."""

    name = "w4a8-int"
    native_kind = nat.GemmKind.U4_S8

    def codes_pass(self) -> None:
        return None  # its activations are int8 rows, not bf16: the float backward

    def act_qdq(self, x: Tensor) -> Tensor:
        xq, xs = nm.int8_rows(x)
        return xq.float() * xs[:, None]

    def _native_run(self, packed: nat.PackedU4):
        def run(rows: Tensor) -> Tensor:
            xq, xs = nm.int8_rows(rows)  # [M, K] int8, [M]
            # y = (sum_k q_x w_hat) * s_x, the codes exact in fp32
            return nat.linear_u4(xq.float(), packed) * xs[:, None]
        return run

    def matmul(self, x: Tensor, qw: QWeight) -> Tensor:
        if self.uses_native(x.device):
            return self.bound(qw, x.device)(x)
        xq, xs = nm.int8_rows(x)  # [M, K] int8, [M]
        if self.uses_kernel(x.device, qw):
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
    """W4A16 NVFP4: E2M1 values, E4M3 scale per 16, fp32 global scale; bf16 activations.
    QWeight: codes [N, K/2] uint8 (two FP4 E2M1 nibbles, low first); scales [N, K/16]
    float8_e4m3fn; global_scale [] float32. Not row-separable: one global scale per tensor,
    shared by a fused group (q/k/v, gate/up): g = 448 * 6 / max over the group of max|w|, as
    vLLM decodes a fused NVFP4 layer with one global scale (and llm-compressor writes one)."""

    name = "w4a16-nvfp4"
    group_scaled = True

    def quantize(self, w: Tensor, group_amax: Tensor | None = None) -> QWeight:
        self.check_weight(w)
        codes, s, g = nm.nvfp4(w.detach(), amax=group_amax)
        return QWeight(self.name, tuple(w.shape), nm.pack_nibbles(codes), s, global_scale=g, group_size=16)

    def dequantize(self, qw: QWeight) -> Tensor:
        return nm.nvfp4_dequantize(nm.unpack_nibbles(qw.codes), qw.scales, qw.global_scale)

    def act_qdq(self, x: Tensor) -> Tensor:
        return x.bfloat16().float()

    def codes_pass(self) -> Bf16ActivationCodes:
        return Bf16ActivationCodes()

    def matmul(self, x: Tensor, qw: QWeight) -> Tensor:
        return self.float_gemm(self.act_qdq(x), qw, lambda: self.dequantize(qw))

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        return (f"emulation: {self.float_gemm_path(device, qw)} on the dequantized fp32 weight "
                "(no FP4 kernel here)")
