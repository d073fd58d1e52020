"""The 8-bit formats: W8A8 int8 (with its gradient pass on codes, `Int8Codes`), W8A8 FP8 per
channel and W8A8 FP8 in 128x128 blocks. The contract is the one of `scheme_base.Scheme`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qarl import native as nat
from qarl.native.isa import has_amx_int8, has_int8_dot
from qarl.quant import kernels as K
from qarl.quant import numerics as nm
from qarl.quant.codes import codes_gemm
from qarl.quant.qweight import QWeight
from qarl.quant.scheme_base import Scheme


@dataclass(frozen=True)
class Int8Scheme(Scheme):
    """W8A8 int8: symmetric per-channel weights, dynamic symmetric per-token activations.
    gemm: "auto" (CUDA: int_mm; a CPU with AMX-INT8: native, qarl.native's AMX tiles, faster
    than torch._int_mm there; a CPU with VNNI: int_mm, oneDNN's int8 GEMM on those
    instructions; else native if it runs here, else onednn, else sgemm; measured by
    benchmarks/quant_kernels.py --parts int8), "native",
    "int_mm", "onednn" or "sgemm"; all give identical int32 accumulators and the same scale
    products, hence identical outputs (see kernels.exact_int8_gemm), on every CPU.
    QWeight: codes [N, K] int8 in [-127, 127]; scales [N] float32 (s = max|w| / 127)."""

    gemm: str = "auto"
    name = "w8a8-int8"
    row_separable = True
    GEMMS = ("auto", "int_mm", "native", "onednn", "sgemm")

    def __post_init__(self):
        if self.gemm not in self.GEMMS:
            raise ValueError(f"{self.name} gemm={self.gemm!r}; valid: {sorted(self.GEMMS)}")

    def method(self, device: torch.device) -> str:
        if self.gemm != "auto":
            return self.gemm
        if device.type == "cuda":
            return "int_mm"
        if self._amx(device):
            return "native"  # AMX tiles beat _int_mm at a few rows and at many (--parts int8)
        if K.onednn_available(device) and has_int8_dot():
            return "int_mm"  # VNNI: faster than qarl.native's AVX2 int8 GEMM (--parts int8)
        if K.native_ok(device):
            return "native"
        return "onednn" if K.onednn_available(device) else "sgemm"

    @staticmethod
    def _amx(device: torch.device) -> bool:
        # qarl.native's int8 GEMM runs on AMX tiles here (the CPU has them and Linux allows them)
        return (device.type == "cpu" and has_amx_int8() and K.native_ok(device)
                and nat.s8_isa() == "amx_int8")

    def quantize(self, w: Tensor) -> QWeight:
        self.check_weight(w)
        codes, scales = _int8_rows(w.detach())  # a weight's rows: one scale per channel
        return QWeight(self.name, tuple(w.shape), codes, scales)

    def dequantize(self, qw: QWeight) -> Tensor:
        # codes.float() * scales: one rounded product per entry; on the CPU in one native pass
        # (torch converts the codes in a pass of their own first)
        if qw.codes.device.type == "cpu" and qw.codes.dim() == 2 and K.native_ok(qw.codes.device):
            return nat.dequant_s8_f32(qw.codes, qw.scales)
        return torch.mul(qw.codes, qw.scales[:, None])

    def act_qdq(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32 and K.native_ok(x.device):
            return nat.qdq_s8_rows_f32(x)  # the same bits in one pass per row
        xq, xs = _int8_rows(x)
        return xq.float() * xs[:, None]

    def dequantize_to(self, qw: QWeight, dtype: torch.dtype) -> Tensor:
        if dtype == torch.bfloat16 and qw.codes.device.type == "cpu" and K.native_ok(qw.codes.device):
            return nat.dequant_s8_bf16(qw.codes, qw.scales)  # one pass, no fp32 [N, K] between
        return super().dequantize_to(qw, dtype)

    def act_qdq_to(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        if dtype == torch.bfloat16 and x.device.type == "cpu" and K.native_ok(x.device) \
                and x.dtype in (torch.float32, torch.bfloat16):
            # one pass per row, where quantize, multiply and cast are separate passes over x,
            # each with its own temporary (benchmarks/step_time.py times the learner's pass)
            return nat.qdq_s8_rows_bf16(x)
        return super().act_qdq_to(x, dtype)

    def _native(self, qw: QWeight, device: torch.device) -> nat.PackedS8:
        return self.prepared(qw, device, "native-s8", lambda: nat.pack_s8(qw.codes, qw.scales))

    def native_operand(self, qw: QWeight, device: torch.device) -> tuple[nat.GemmKind, object] | None:
        method = self.method(device)
        if method == "native" or (method == "int_mm" and K.native_ok(device)):
            return (nat.GemmKind.S8, self._native(qw, device))  # the same bits as int_mm
        return None

    def native_rows(self, device: torch.device) -> int | None:
        return INT_MM_MIN_ROWS if self.method(device) == "int_mm" else None

    def bound(self, qw: QWeight, device: torch.device):
        if self.method(device) == "native":
            packed = self._native(qw, device)
            return lambda rows: nat.linear_s8_dynamic(rows.float(), packed)
        return super().bound(qw, device)

    def kernel_for_gradients(self, device: torch.device,
                             compute: torch.dtype = torch.float32) -> bool:
        # fp32 pass: exact int32 sums at int8 speed (int_mm / native; AVX2 kept as it was). A
        # bf16 pass (CUDA, CPUs with AMX-BF16) runs the bf16 GEMM on the weight dequantized once
        # per version, as a full-precision learner's pass does: there the bf16 GEMM is faster
        # than torch._int_mm even before the activations' quantization and scaling, which
        # _int_mm adds (benchmarks/step_time.py, train.quant_backward as an arm's override)
        return compute == torch.float32

    def _rows_method(self, x: Tensor) -> str:
        method = self.method(x.device)
        if method == "int_mm" and x.shape[0] < INT_MM_MIN_ROWS and K.native_ok(x.device):
            method = "native"  # faster at a few rows; the same exact sums, the same bits
        return method

    def matmul(self, x: Tensor, qw: QWeight) -> Tensor:
        method = self._rows_method(x)
        if method == "native":
            # int8_rows, the exact GEMM and (acc * s_x) * s_w, like matmul_codes, in one call
            return nat.linear_s8_dynamic(x.float(), self._native(qw, x.device))
        return self.matmul_codes(_int8_rows(x), qw)

    def codes_pass(self) -> Int8Codes:
        return Int8Codes(self)

    def matmul_codes(self, codes: tuple[Tensor, Tensor], qw: QWeight) -> Tensor:
        # rows the native kernel runs come here on AMX only (Int8Codes.forward_codes);
        # elsewhere method is a GEMM of kernels.exact_int8_gemm
        xq, xs = codes  # [M, K] int8, [M]
        method = self.method(xq.device)
        if method == "native":
            return nat.linear_s8_codes(xq, xs, self._native(qw, xq.device))
        operand = None
        if method in ("sgemm", "onednn"):
            operand = self.prepared(qw, xq.device, method,
                                    lambda: K.int8_chunks(qw.codes, method == "onednn"))
        elif xq.device.type == "cpu":  # int_mm: oneDNN is far faster on a contiguous [K, N]
            operand = self.prepared(qw, xq.device, "int_mm-kn", lambda: [qw.codes.t().contiguous()])
        acc = K.exact_int8_gemm(xq, qw.codes, method, operand)  # [M, N] int32, exact
        # y = (acc * s_x) * s_w
        if acc.device.type == "cpu" and K.native_ok(acc.device):
            return nat.scale_s32(acc, xs, qw.scales)  # the same two products, one pass
        return acc.float() * xs[:, None] * qw.scales[None, :]

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        method = self.method(device)
        if method == "native" and self._amx(device):
            return ("native int8 GEMM (qarl.native amx_int8: int8 tiles, exact int32 sums = "
                    "torch._int_mm bit for bit)")
        if method == "native":
            return (f"native int8 GEMM (qarl.native {nat.s8_isa()}: the activation sign on the "
                    "weight, exact int32 sums = torch._int_mm bit for bit)")
        if method in ("sgemm", "onednn"):
            return (f"exact int8 GEMM as fp32 {method} on integer codes in K-chunks of 1024 "
                    "(= torch._int_mm bit for bit; _int_mm is slow on CPUs without VNNI)")
        where = ("oneDNN on VNNI / AMX-INT8" if device.type == "cpu" and has_int8_dot()
                 else "cuBLASLt" if device.type == "cuda" else "oneDNN")
        return f"torch._int_mm ({where}: exact int32 accumulation)"


# Below this many rows qarl.native's int8 GEMM (VNNI where the CPU has it) beats oneDNN's
# torch._int_mm on CPUs with VNNI; from it on oneDNN is the faster (measured by
# benchmarks/quant_kernels.py --parts int8 --rows 1,16,32,256; re-measure before changing it).
# Integer sums are exact, so the switch never changes a bit.
INT_MM_MIN_ROWS = 16


def _int8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """numerics.int8_rows of activations [M, K]: qarl.native's one-pass quantizer on a CPU
    where it runs (the same bits in one pass), else the torch ops."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and K.native_ok(x.device):
        return nat.quantize_s8_rows(x)
    return nm.int8_rows(x)


@dataclass(frozen=True)
class Int8Codes:
    """W8A8 int8's gradient pass on codes (qarl.quant.codes): the forward on the activations'
    int8 codes where they are computed outside the kernel as fast, dL/dx on the weight's codes
    (SwitchBack) and dL/dW on the activation codes."""

    scheme: Int8Scheme
    grad_input_on_codes = True

    def prefers(self, device: torch.device) -> bool:
        # wherever the format's int8 GEMM is a real one: torch._int_mm on VNNI, qarl.native's
        # on AMX tiles, VNNI or AVX2, whose int8 products outrun MKL's fp32 GEMM at the
        # learner's shapes even without int8 dot instructions; CUDA learners run bf16 there
        # ('auto' compute); measured by benchmarks/step_time.py
        return device.type == "cpu" and self.scheme.method(device) in ("int_mm", "native")

    def forward_codes(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        # where the native kernel runs these rows it quantizes inside: no codes to keep, but
        # on AMX tiles it runs on codes as fast (linear_s8_codes), and the backward keeps them
        native = self.scheme._rows_method(x) == "native"
        return None if native and not self.scheme._amx(x.device) else _int8_rows(x)

    def matmul(self, codes: tuple[Tensor, Tensor], qw: QWeight) -> Tensor:
        return self.scheme.matmul_codes(codes, qw)

    def keep(self, x: Tensor) -> None:
        return None  # the forward's codes, where it ran on codes; else x itself

    def x_hat(self, codes: tuple[Tensor, Tensor]) -> Tensor:
        xq, xs = codes
        return xq.float() * xs[:, None]  # = act_qdq(x) bit for bit

    def grad_input(self, g: Tensor, qw: QWeight) -> Tensor:
        # SwitchBack (Wortsman et al. 2023): W_hat[n, k] = s_w[n] q[n, k] varies along the
        # contraction n, so s_w moves onto g's columns; g' = g s_w is quantized per row like an
        # activation and g W_hat ~ s_g[m] sum_n q_g[m, n] q[n, k], the sum exact in int32. The
        # codes [N, K] are already the [contraction, output] operand torch._int_mm takes; the
        # native GEMM takes them transposed into its panels (`pack_s8_t`, once per weight
        # version) and gives the same sums times s_g times 1.0: the same bits. The one
        # approximation is g' rounded to int8: at most half a step, s_g / 2, per element.
        g = g.float()
        native = g.device.type == "cpu" and K.native_ok(g.device)
        # one pass, g' never written out, where qarl.native runs (the same bits)
        gq, gs = nat.quantize_s8_rows(g, qw.scales) if native else nm.int8_rows(g * qw.scales)
        if native and self.scheme.method(g.device) == "native":
            packed = self.scheme.prepared(qw, g.device, "native-s8-t",
                                          lambda: nat.pack_s8_t(qw.codes))
            return nat.linear_s8_codes(gq, gs, packed)
        acc = K.exact_int8_gemm(gq, qw.codes, "int_mm", [qw.codes])  # [M, K] int32
        return nat.scale_s32(acc, gs) if native else acc.float() * gs[:, None]

    def grad_weight(self, g: Tensor, codes: tuple[Tensor, Tensor]) -> Tensor:
        # x_hat[m, k] = s_x[m] q_x[m, k]: s_x moves onto g's rows (the contraction), and the
        # codes, integers of at most 8 bits, are exact in bf16: a bf16 GEMM rounds g' = g s_x
        # only (2^-9 relative), where bf16 GEMMs are fast (`bf16_fast`); fp32 elsewhere
        xq, xs = codes
        return codes_gemm(g.float() * xs[:, None], xq)


@dataclass(frozen=True)
class Fp8Scheme(Scheme):
    """W8A8 FP8 E4M3: per-channel weight scales, dynamic per-token activation scales.
    QWeight: codes [N, K] float8_e4m3fn; scales [N] float32 (s = max|w| / 448)."""

    name = "w8a8-fp8"
    row_separable = True

    def quantize(self, w: Tensor) -> QWeight:
        self.check_weight(w)
        codes, scales = nm.fp8_rows(w.detach())
        return QWeight(self.name, tuple(w.shape), codes, scales)

    def dequantize(self, qw: QWeight) -> Tensor:
        return qw.codes.float() * qw.scales[:, None]

    def act_qdq(self, x: Tensor) -> Tensor:
        xq, xs = nm.fp8_rows(x)
        return xq.float() * xs[:, None]

    def matmul(self, x: Tensor, qw: QWeight) -> Tensor:
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
    """W8A8 FP8 E4M3, DeepSeek-V3 blocks: 128x128 weight tiles, 1x128 activation groups.
    QWeight: codes [N, K] float8_e4m3fn; scales [ceil(N/128), ceil(K/128)] float32;
    group_size 128. Not row-separable: a tile's scale spans 128 rows."""

    name = "w8a8-fp8-block"
    BLOCK = 128  # weight tile edge and activation group size

    def quantize(self, w: Tensor) -> QWeight:
        self.check_weight(w)
        codes, scales = nm.fp8_blocks(w.detach(), self.BLOCK, self.BLOCK)
        return QWeight(self.name, tuple(w.shape), codes, scales, group_size=self.BLOCK)

    def dequantize(self, qw: QWeight) -> Tensor:
        N, Kdim = qw.shape
        return qw.codes.float() * nm.expand_blocks(qw.scales, self.BLOCK, self.BLOCK, N, Kdim)

    def act_qdq(self, x: Tensor) -> Tensor:
        xq, xs = nm.fp8_blocks(x, 1, self.BLOCK)
        return xq.float() * nm.expand_blocks(xs, 1, self.BLOCK, *x.shape)

    def _weight_blocks(self, qw: QWeight) -> tuple[Tensor, Tensor]:
        N, Kdim = qw.shape
        kb = -(-Kdim // self.BLOCK)
        w = nm.pad_to(qw.codes.double(), N, kb * self.BLOCK).view(N, kb, self.BLOCK)
        blocks = w.permute(1, 2, 0).contiguous()  # [KB, 128, N]
        scales = qw.scales.repeat_interleave(self.BLOCK, 0)[:N].t().contiguous()  # [KB, N]
        return blocks, scales

    def matmul(self, x: Tensor, qw: QWeight) -> Tensor:
        xq, xs = nm.fp8_blocks(x, 1, self.BLOCK)  # [M, K] e4m3, [M, KB]
        blocks, scales = self.prepared(qw, x.device, "blocks", lambda: self._weight_blocks(qw))
        return K.exact_fp8_block_gemm(xq, xs, blocks, scales, self.BLOCK)

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        return ("exact block-FP8 emulation: fp64 per-128 partial sums, fixed-order fp32 "
                "scale promotion (no block-scaled FP8 kernel is wired)")
