"""Matmul kernels, each BATCH-INVARIANT: row i of the output has the same bits whatever the
other rows are and however many there are (the engine decodes 1 row per sequence, the learner
runs N*L rows at once; QaRL needs both to produce identical bits).

How each kernel earns invariance:
- `exact_int8_gemm`: integer codes, so the dot product is exact in any summation order.
  `torch._int_mm` computes it in int32; `sgemm` / `onednn` compute it with fp32 GEMMs (MKL,
  or oneDNN on a pre-packed weight) on integer-valued floats in K-chunks of at most 1024
  (|q| <= 127, so every partial sum is an integer below 1024 * 127^2 < 2^24, which fp32
  represents exactly), then add chunks in int32. All give the same int32 result; the fp32 ones
  are the faster ones on CPUs without VNNI (no benchmark times these fallbacks: re-measure
  before changing `Int8Scheme.method`'s order).
- `exact_fp8_gemm` / `exact_fp8_block_gemm`: every E4M3 value is a multiple of 2^-9 below
  2^9, so a product is a multiple of 2^-18 below 2^18 and a sum of up to 2^17 of them is exact
  in fp64 (53-bit significand): fp64 matmul over E4M3 values is the exact dot product.
- `int4pack_mm`: PyTorch's CPU int4 kernel, invariant by test, not by construction (the tests
  check it per shape).
- `batch_invariant_linear`: arbitrary floats, no exact formulation. Rows are processed in
  fixed tiles of BI_TILE rows (zero-padded), one `torch.mm` per tile, so every row goes through
  a GEMM call of the same shape [BI_TILE, K] x [K, N]; tested invariant over shapes/positions.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from qarl import native
from qarl.native.isa import cpu_flags, cpu_vendor

BI_TILE = 16  # rows per GEMM call in batch_invariant_linear
INT8_SGEMM_CHUNK = 1024  # 1024 * 127 * 127 < 2^24: fp32 partial sums stay exact integers
EXACT_ROW_CHUNK = 256  # rows per fp64 call in the FP8 emulation (bounds its memory)


def batch_invariant_linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x w^T (+ b) with row-wise bits independent of the batch. x [M, K], w [N, K] -> [M, N].

    Computed in the dtype of w (x is cast to it). Cost: a row alone costs one [16, K] GEMM
    instead of a GEMV (`benchmarks/quant_kernels.py --parts layers` times it against F.linear).
    """
    M = x.shape[0]
    pad = (-M) % BI_TILE
    xp = F.pad(x.to(w.dtype), (0, 0, 0, pad)) if pad else x.to(w.dtype)
    wt = w.t()  # [K, N] view
    y = torch.cat([torch.mm(xp[i:i + BI_TILE], wt) for i in range(0, M + pad, BI_TILE)])[:M]
    return y if bias is None else y + bias.to(y.dtype)


def int8_chunks(wq: Tensor, packed: bool) -> list[Tensor]:
    """Weight codes [N, K] int8 -> fp32 K-chunks for the sgemm method, oneDNN-packed if asked
    (a one-time layout change; the values stay the integer codes)."""
    chunks = [wq[:, k0:k0 + INT8_SGEMM_CHUNK].float() for k0 in range(0, wq.shape[1], INT8_SGEMM_CHUNK)]
    if packed:
        chunks = [torch.ops.mkldnn._reorder_linear_weight(c, 16) for c in chunks]
    return chunks


def native_ok(device: torch.device) -> bool:
    """qarl.native's CPU kernels run on this device (CPU with AVX2/FMA and a C compiler)."""
    return device.type == "cpu" and native.available()


def onednn_available(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


def exact_int8_gemm(xq: Tensor, wq: Tensor, method: str, chunks: list[Tensor] | None = None) -> Tensor:
    """Exact sum_k xq[m, k] wq[n, k] as int32 [M, N]. xq [M, K] int8, wq [N, K] int8.

    method "int_mm" uses torch._int_mm (pass `chunks = wq.t().contiguous()`, cached: oneDNN is
    far slower on the transposed view); "sgemm" fp32 GEMMs over exact K-chunks, "onednn" the
    same on oneDNN-packed chunks (pass the cached `int8_chunks(wq, packed)` to skip converting
    the weight on every call). All three return the same int32 tensor.
    """
    if method == "int_mm":
        M = xq.shape[0]
        wt = chunks[0] if chunks is not None else wq.t()  # [K, N]: a cached contiguous copy
        if xq.device.type == "cuda" and M <= 16:  # cuBLASLt int8 needs M > 16
            return torch._int_mm(F.pad(xq, (0, 0, 0, 17 - M)), wt)[:M]
        return torch._int_mm(xq.contiguous(), wt)
    if method not in ("sgemm", "onednn"):
        raise ValueError(f"unknown int8 GEMM method {method!r}; valid: ['int_mm', 'onednn', 'sgemm']")
    chunks = int8_chunks(wq, method == "onednn") if chunks is None else chunks
    xf = xq.float()
    acc = None
    for i, w in enumerate(chunks):
        x = xf[:, i * INT8_SGEMM_CHUNK:(i + 1) * INT8_SGEMM_CHUNK]
        if method == "onednn":
            part = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        else:
            part = torch.mm(x, w.t())
        part = part.to(torch.int32)  # exact: |part| < 2^24
        acc = part if acc is None else acc + part
    return acc


def exact_fp8_gemm(xq: Tensor, w64: Tensor) -> Tensor:
    """Exact sum_k xq[m, k] w[n, k] rounded once to fp32. xq [M, K] e4m3, w64 [N, K] float64."""
    out = [
        torch.mm(xq[i:i + EXACT_ROW_CHUNK].double(), w64.t()).float()
        for i in range(0, xq.shape[0], EXACT_ROW_CHUNK)
    ]
    return torch.cat(out)


def exact_fp8_block_gemm(
    xq: Tensor,  # [M, K] float8_e4m3fn
    x_scales: Tensor,  # [M, KB] float32, one per 1x128 activation group
    w_blocks: Tensor,  # [KB, 128, N] float64, E4M3 weight values, K zero-padded
    w_scales: Tensor,  # [KB, N] float32, each 128x128 block scale expanded over its columns
    block: int,
) -> Tensor:  # [M, N] float32
    """DeepSeek-V3 block FP8: y[m, n] = sum_kb (sx[m, kb] sw[kb, n]) * P[kb, m, n], where
    P[kb] = sum over the kb-th 128 columns of x codes * w codes (exact in fp64), and the sum
    over kb is a fixed-order loop of elementwise fp32 ops (the per-block promotion of the
    DeepSeek kernel), hence row-independent."""
    M, K = xq.shape
    KB = w_blocks.shape[0]
    outs = []
    for i in range(0, M, EXACT_ROW_CHUNK):
        x = F.pad(xq[i:i + EXACT_ROW_CHUNK].double(), (0, KB * block - K))  # [m, KB*128]
        x = x.view(x.shape[0], KB, block).transpose(0, 1)  # [KB, m, 128]
        partial = torch.bmm(x, w_blocks).float()  # [KB, m, N], exact before the cast
        sx = x_scales[i:i + EXACT_ROW_CHUNK]  # [m, KB]
        y = partial[0] * (sx[:, 0, None] * w_scales[0][None, :])
        for kb in range(1, KB):
            y = y + partial[kb] * (sx[:, kb, None] * w_scales[kb][None, :])
        outs.append(y)
    return torch.cat(outs)


def int4pack_prepare(u: Tensor, scales: Tensor, zeros: Tensor | None) -> tuple[Tensor, Tensor]:
    """u [N, K] uint8 in [0, 15], scales/zeros [N, G] bf16 -> (packed weight, [G, N, 2] bf16).

    The kernel dequantizes (u - 8) * s + z, which is our convention with z = 0 if symmetric.
    """
    packed = torch._convert_weight_to_int4pack_for_cpu(u.to(torch.int32).contiguous(), 2)
    z = torch.zeros_like(scales) if zeros is None else zeros
    scales_and_zeros = torch.stack([scales, z], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros.to(torch.bfloat16)


def int4pack_mm(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    """x [M, K] bf16 -> [M, N] bf16 via torch._weight_int4pack_mm_for_cpu."""
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


# The learner's fp32 GEMMs on the CPU: MKL (torch's own matmul) or oneDNN. MKL runs its AVX2
# code on AMD CPUs; oneDNN dispatches on the CPU's flags and runs AVX-512 there, so on AMD CPUs
# with AVX-512 oneDNN is the faster library at the learner's shapes (the decoder's projections
# and the lm_head; forward, grad-input and grad-weight alike). Measured by
# benchmarks/step_time.py run with QARL_CPU_GEMM=mkl and QARL_CPU_GEMM=onednn, which override
# the choice (docs/performance.md).
CPU_GEMM_ENV = "QARL_CPU_GEMM"
CPU_GEMMS = ("mkl", "onednn")


def cpu_fp32_gemm(device: torch.device) -> str | None:
    """Which library runs the learner's fp32 gradient-pass GEMMs on `device`: "onednn" on AMD
    CPUs with AVX-512 (or as QARL_CPU_GEMM asks), "mkl" on other CPUs, None off the CPU
    (torch's own)."""
    if device.type != "cpu":
        return None
    asked = os.environ.get(CPU_GEMM_ENV, "")
    if asked:
        if asked not in CPU_GEMMS:
            raise ValueError(f"{CPU_GEMM_ENV}={asked!r}; valid: {list(CPU_GEMMS)} (or unset)")
        return asked if asked == "mkl" or onednn_available(device) else "mkl"
    # AVX2-only AMD CPUs keep MKL: there both libraries run AVX2 code and MKL is the faster at
    # the learner's shapes (benchmarks/step_time.py with QARL_CPU_GEMM, as above)
    amd_avx512 = cpu_vendor() == "AuthenticAMD" and "avx512f" in cpu_flags()
    return "onednn" if onednn_available(device) and amd_avx512 else "mkl"


# oneDNN keeps a primitive, with its buffers, per GEMM shape; a learner's row counts change
# every micro-batch, so without padding that cache grows the run's peak RSS step after step.
# Row counts (and a row-count reduction) padded with zeros to a multiple of this keep the
# shapes few; zero rows add exact zeros. Peak RSS: benchmarks/step_time.py --rounds.
ONEDNN_ROWS = 64


def _padded(t: Tensor, rows: int, cols: int) -> Tensor:
    pad_r, pad_c = -rows % ONEDNN_ROWS if rows else 0, -cols % ONEDNN_ROWS if cols else 0
    return F.pad(t, (0, pad_c, 0, pad_r)) if pad_r or pad_c else t


def onednn_mm(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) fp32 by oneDNN, M and K padded to ONEDNN_ROWS."""
    M, K = a.shape
    a = _padded(a, M, K)
    b = _padded(b, K, 0)
    # oneDNN's linear computes x w^T; b^T is a view (oneDNN takes strided operands)
    y = torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")
    return y[:M] if y.shape[0] != M else y


def learner_mm(a: Tensor, b: Tensor) -> Tensor:
    """a [M, K] @ b [K, N] for the learner's gradient pass: oneDNN where `cpu_fp32_gemm`
    picks it for fp32 operands, torch's matmul otherwise. The same product up to fp32
    summation order (a gradient; no logp value comes from it)."""
    if a.dtype == b.dtype == torch.float32 and cpu_fp32_gemm(a.device) == "onednn":
        return onednn_mm(a, b)
    return a @ b


def cuda_fp8_supported(device: torch.device, n: int, k: int) -> bool:
    """torch._scaled_mm with row-wise scales needs compute capability >= 8.9 (Ada, Hopper)
    and K, N multiples of 16."""
    return (device.type == "cuda" and n % 16 == 0 and k % 16 == 0
            and torch.cuda.get_device_capability(device) >= (8, 9))


def cuda_scaled_mm(xq: Tensor, x_scales: Tensor, wq: Tensor, w_scales: Tensor) -> Tensor:
    """Row-wise scaled FP8 GEMM on CUDA: (xq * sx[:, None]) @ (wq * sw[:, None])^T -> bf16
    (tested by tests/gpu, skipped without CUDA)."""
    return torch._scaled_mm(
        xq, wq.t(), scale_a=x_scales[:, None].contiguous(), scale_b=w_scales[None, :].contiguous(),
        out_dtype=torch.bfloat16,
    )
