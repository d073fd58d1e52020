"""Packed weights and the three GEMMs (fp32, W8A8 int8, int4 groups): see the package doc."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qarl.native.ffi import _lib, _ptr, _rows, _threads

NR = 24  # output columns per fp32 / int4 panel (kernels.c)
NR8 = 16  # output columns per int8 panel (kernels_s8.c)


def _panels(n: int) -> int:
    return (n + NR - 1) // NR


@dataclass(frozen=True)
class PackedF32:
    data: Tensor  # [P * K * 24] float32, panels of 24 output columns, k-major
    n: int
    k: int


@dataclass(frozen=True)
class PackedS8:
    data: Tensor  # [P8 * Kq * 16 * 4] int8 (Kq = ceil(K / 4)), 4 consecutive k per column
    scales: Tensor  # [P8 * 16] float32 per-channel weight scales, zero padded
    n: int
    k: int


@dataclass(frozen=True)
class PackedU4:
    data: Tensor  # [P * K/2 * 24] uint8, two k per byte (low nibble first)
    scales: Tensor  # [P * G * 24] float32
    zeros: Tensor | None  # [P * G * 24] float32 or None (symmetric)
    group_size: int
    n: int
    k: int


def pack_f32(w: Tensor) -> PackedF32:
    """w [N, K] float32 -> packed panels (a one-time copy of the weight)."""
    if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
        raise ValueError(f"pack_f32 expects a 2-D CPU float32 weight, got {w.dtype} {tuple(w.shape)}")
    w = w.detach().contiguous()
    n, k = w.shape
    out = torch.empty(_panels(n) * k * NR, dtype=torch.float32)
    _lib().qarl_pack_f32(w.data_ptr(), n, k, k, out.data_ptr(), _threads())
    return PackedF32(out, n, k)


def linear_f32(x: Tensor, w: PackedF32, bias: Tensor | None = None,
               residual: Tensor | None = None) -> Tensor:
    """x [..., K] float32 -> x W^T (+ bias [N]) (+ residual [..., N]): [..., N] float32."""
    x2 = _rows(x, torch.float32, w.k, "linear_f32")
    m = x2.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    b = None if bias is None else bias.detach().float().contiguous()
    r = None if residual is None else residual.reshape(m, w.n).float().contiguous()
    _lib().qarl_linear_f32(x2.data_ptr(), m, w.k, w.k, w.data.data_ptr(), w.n, _ptr(b), _ptr(r),
                           w.n, y.data_ptr(), w.n, _threads())
    return y if x.dim() == 2 else y.view(*x.shape[:-1], w.n)


def _check_s8_codes(codes: Tensor, what: str) -> Tensor:
    if codes.dim() != 2 or codes.dtype != torch.int8:
        raise ValueError(f"{what} expects int8 codes [N, K], got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if codes.numel() and int(codes.min()) == -128:
        raise ValueError(f"{what}: weight codes must lie in [-127, 127] (symmetric int8); "
                         "got -128. Quantize with numerics.int8_rows, which clamps to 127.")
    return codes.contiguous()


def _pack_s8(pack, codes: Tensor, n: int, k: int, scales: Tensor | float) -> PackedS8:
    """The panels `pack` (qarl_pack_s8 or qarl_pack_s8_t) writes of `codes` for a product
    with n output columns and a contraction of k, with those columns' scales."""
    p8 = (n + NR8 - 1) // NR8
    out = torch.empty(p8 * ((k + 3) // 4) * 4 * NR8, dtype=torch.int8)
    pack(codes.data_ptr(), *codes.shape, codes.shape[1], out.data_ptr(), _threads())
    ws = torch.zeros(p8 * NR8, dtype=torch.float32)
    ws[:n] = scales
    return PackedS8(out, ws, n, k)


def pack_s8(codes: Tensor, scales: Tensor) -> PackedS8:
    """codes [N, K] int8 in [-127, 127], scales [N] float32 (per output channel) -> packed.

    -128 is refused: the kernel moves signs onto the weight, and -(-128) does not fit int8.
    """
    if scales.shape != codes.shape[:1]:
        raise ValueError(f"pack_s8 expects scales [N] for codes {tuple(codes.shape)}, got "
                         f"{tuple(scales.shape)}")
    codes = _check_s8_codes(codes, "pack_s8")
    return _pack_s8(_lib().qarl_pack_s8, codes, *codes.shape, scales.float())


def pack_s8_t(codes: Tensor) -> PackedS8:
    """codes [N, K] int8 in [-127, 127] -> their transpose [K, N] packed, with unit scales:
    `pack_s8(codes.t().contiguous(), ones(K))` bit for bit, in one pass that never writes the
    transpose. `linear_s8_codes(gq, gs, pack_s8_t(codes))` is then (sum_n gq[m, n]
    codes[n, k]) * gs[m]: the product of the straight-through backward on the weight's codes
    (qarl.quant.schemes_8bit.Int8Codes.grad_input)."""
    codes = _check_s8_codes(codes, "pack_s8_t")
    n, k = codes.shape
    return _pack_s8(_lib().qarl_pack_s8_t, codes, k, n, 1.0)


F32_ISAS = ("avx2", "avx512")  # the fp32 GEMM's instruction sets, by level (the same bits)
S8_ISAS = ("avx2", "avx_vnni", "avx512_vnni", "amx_int8")  # the int8 GEMM's instruction sets, by level


def _use_isa(levels: tuple[str, ...], what: str, name: str, setter) -> str:
    if name not in levels:
        raise ValueError(f"unknown {what} instruction set {name!r}; valid: {list(levels)}")
    return levels[setter(levels.index(name))]


def f32_isa() -> str:
    """The instruction set the fp32 GEMM (and the int4 one, which runs its chains) runs here:
    the best this CPU has (qarl_f32_isa)."""
    return F32_ISAS[_lib().qarl_f32_isa()]


def use_f32_isa(name: str) -> str:
    """Run the fp32 GEMM with `name` (of F32_ISAS; capped at what this CPU has) from now on,
    as `use_s8_isa` does for the int8 GEMM. Returns the one now in use."""
    return _use_isa(F32_ISAS, "fp32", name, _lib().qarl_f32_set_isa)


def s8_isa() -> str:
    """The instruction set the int8 GEMM runs here: the best this CPU has (qarl_s8_isa)."""
    return S8_ISAS[_lib().qarl_s8_isa()]


def use_s8_isa(name: str) -> str:
    """Run the int8 GEMM with `name` (of S8_ISAS; capped at what this CPU has) from now on:
    for comparing the instruction sets, whose outputs are the same bits. Returns the one now
    in use."""
    return _use_isa(S8_ISAS, "int8", name, _lib().qarl_s8_set_isa)


def linear_s8_dynamic(x: Tensor, w: PackedS8) -> Tensor:
    """W8A8 with dynamic per-token activations: x [M, K] float32 -> [M, N] float32,
    y = (sum_k q_x w_q) * s_x * s_w with (q_x, s_x) = numerics.int8_rows(x) computed in the
    kernel (the same codes and scales bit for bit) and the int32 sum exact."""
    x2 = _rows(x, torch.float32, w.k, "linear_s8_dynamic")
    m = x2.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    _lib().qarl_linear_s8_dynamic(x2.data_ptr(), m, w.k, w.k, w.data.data_ptr(),
                                  w.scales.data_ptr(), w.n, y.data_ptr(), w.n,
                                  _threads())
    return y


def linear_s8_codes(xq: Tensor, xs: Tensor, w: PackedS8) -> Tensor:
    """`linear_s8_dynamic` on activations quantized already: xq [M, K] int8 and xs [M] float32
    (numerics.int8_rows of x) -> [M, N] float32, the same bits as `linear_s8_dynamic(x, w)`."""
    if (xq.dim() != 2 or xq.dtype != torch.int8 or xq.shape[1] != w.k
            or xs.shape != xq.shape[:1] or xs.dtype != torch.float32):
        raise ValueError(f"linear_s8_codes expects int8 codes [M, {w.k}] and float32 scales [M], "
                         f"got {xq.dtype} {tuple(xq.shape)}, {xs.dtype} {tuple(xs.shape)}")
    xq = xq if xq.stride(1) == 1 else xq.contiguous()
    xs = xs.contiguous()
    m = xq.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    _lib().qarl_linear_s8_codes(xq.data_ptr(), m, w.k, xq.stride(0), xs.data_ptr(),
                                w.data.data_ptr(), w.scales.data_ptr(), w.n, y.data_ptr(), w.n,
                                _threads())
    return y


def quantize_s8_rows(x: Tensor, col_scales: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] float32 -> (codes [M, K] int8, scales [M] float32): numerics.int8_rows bit for
    bit (the quantizer `linear_s8_dynamic` runs inside), one pass per row, rows in parallel.
    With col_scales [K] float32: numerics.int8_rows(x * col_scales) bit for bit, the product
    never written out."""
    x2 = _rows(x, torch.float32, x.shape[-1], "quantize_s8_rows")
    m, k = x2.shape
    codes = torch.empty(m, k, dtype=torch.int8)
    scales = torch.empty(m, dtype=torch.float32)
    if col_scales is None:
        _lib().qarl_quantize_s8_rows(x2.data_ptr(), m, k, k, codes.data_ptr(), k,
                                     scales.data_ptr(), _threads())
        return codes, scales
    cs = col_scales.float().contiguous()
    if cs.shape != (k,):
        raise ValueError(f"quantize_s8_rows: col_scales of shape {tuple(cs.shape)} for rows of {k}")
    _lib().qarl_quantize_s8_rows_scaled(x2.data_ptr(), m, k, k, cs.data_ptr(), codes.data_ptr(),
                                        k, scales.data_ptr(), _threads())
    return codes, scales


def qdq_s8_rows_bf16(x: Tensor) -> Tensor:
    """x [M, K] float32 or bfloat16 -> x_hat [M, K] bfloat16: the rows quantized as
    numerics.int8_rows quantizes their fp32 values, dequantized and rounded to bf16, what
    `(q.float() * s[:, None]).bfloat16()` gives, bit for bit, in one pass per row."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"qdq_s8_rows_bf16 expects float32 or bfloat16 rows, got {x.dtype}")
    x2 = _rows(x, x.dtype, x.shape[-1], "qdq_s8_rows_bf16")
    m, k = x2.shape
    out = torch.empty(m, k, dtype=torch.bfloat16)
    _lib().qarl_qdq_s8_rows_bf16(x2.data_ptr(), int(x2.dtype == torch.bfloat16), m, k, k,
                                 out.data_ptr(), k, _threads())
    return out


def dequant_s8_bf16(codes: Tensor, scales: Tensor) -> Tensor:
    """codes [N, K] int8, scales [N] float32 -> [N, K] bfloat16: `(codes * scales[:, None])
    .bfloat16()` bit for bit, in one pass without the fp32 tensor between."""
    return _dequant_s8(codes, scales, torch.bfloat16)


def dequant_s8_f32(codes: Tensor, scales: Tensor) -> Tensor:
    """codes [N, K] int8, scales [N] float32 -> [N, K] float32: `codes * scales[:, None]` bit
    for bit, in one pass (torch converts the codes in a pass of their own first)."""
    return _dequant_s8(codes, scales, torch.float32)


def _dequant_s8(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    name = {torch.bfloat16: "dequant_s8_bf16", torch.float32: "dequant_s8_f32"}[dtype]
    if codes.dim() != 2 or codes.dtype != torch.int8 or scales.shape != codes.shape[:1]:
        raise ValueError(f"{name} expects int8 codes [N, K] and scales [N], got "
                         f"{codes.dtype} {tuple(codes.shape)}, {tuple(scales.shape)}")
    codes, scales = codes.contiguous(), scales.float().contiguous()
    out = torch.empty(codes.shape, dtype=dtype)
    getattr(_lib(), f"qarl_{name}")(codes.data_ptr(), scales.data_ptr(), codes.shape[0],
                                    codes.shape[1], out.data_ptr(), _threads())
    return out


def qdq_s8_rows_f32(x: Tensor) -> Tensor:
    """x [..., K] float32 -> x_hat [..., K] float32: the rows quantized as numerics.int8_rows
    quantizes them and dequantized, what `q.float() * s[:, None]` gives, bit for bit, in one
    pass per row."""
    if x.dtype != torch.float32:
        raise ValueError(f"qdq_s8_rows_f32 expects float32 rows, got {x.dtype}")
    x2 = _rows(x, x.dtype, x.shape[-1], "qdq_s8_rows_f32")
    m, k = x2.shape
    out = torch.empty(m, k, dtype=torch.float32)
    _lib().qarl_qdq_s8_rows_f32(x2.data_ptr(), m, k, k, out.data_ptr(), k, _threads())
    return out.reshape(x.shape)


def scale_s32(acc: Tensor, xs: Tensor, ws: Tensor | None = None) -> Tensor:
    """acc [M, N] int32 (an exact int8 GEMM), xs [M], ws [N] float32 -> (acc * xs) * ws [M, N]
    float32, the same two rounded products as `acc.float() * xs[:, None] * ws[None]`, in one
    pass; without ws, `acc.float() * xs[:, None]`."""
    m, n = acc.shape
    acc = acc.contiguous()
    xs = xs.float().contiguous()
    ws = None if ws is None else ws.float().contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    ws_ptr = None if ws is None else ws.data_ptr()
    _lib().qarl_scale_s32(acc.data_ptr(), m, n, xs.data_ptr(), ws_ptr, y.data_ptr(), _threads())
    return y


def _group_panels(t: Tensor, n: int) -> Tensor:
    # [N, G] -> [P, G, 24] float32, columns past N zero
    p = _panels(n)
    out = torch.zeros(p * NR, t.shape[1], dtype=torch.float32)
    out[:n] = t.float()
    return out.view(p, NR, -1).transpose(1, 2).contiguous()


def pack_u4(u: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int) -> PackedU4:
    """u [N, K] uint8 in [0, 15], scales/zeros [N, K/group] (w = (u - 8) s + z) -> packed."""
    n, k = u.shape
    if u.dtype != torch.uint8 or k % group_size or k % 2 or scales.shape != (n, k // group_size):
        raise ValueError(
            f"pack_u4 expects uint8 codes [N, K] with K a multiple of group_size={group_size} "
            f"and scales [N, K/group]; got {u.dtype} {tuple(u.shape)}, {tuple(scales.shape)}"
        )
    u = u.contiguous()
    out = torch.empty(_panels(n) * (k // 2) * NR, dtype=torch.uint8)
    _lib().qarl_pack_u4(u.data_ptr(), n, k, k, out.data_ptr(), _threads())
    z = None if zeros is None else _group_panels(zeros, n)
    return PackedU4(out, _group_panels(scales, n), z, group_size, n, k)


def quantize_u4(w: Tensor, group_size: int, symmetric: bool, dequantized: bool = False
                ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """w [N, K] float32 -> (codes [N, K/2] uint8 packed as numerics.pack_nibbles, scales and
    zeros [N, K/group] bfloat16 (zeros None when symmetric), the dequantized weight [N, K]
    float32 or None): numerics.int4_groups, pack_nibbles and int4_dequantize bit for bit, in
    one pass over w, rows in parallel."""
    n, k = w.shape
    if w.dtype != torch.float32 or k % group_size or group_size % 8:
        raise ValueError(f"quantize_u4 expects float32 [N, K] with K a multiple of "
                         f"group_size={group_size} (a multiple of 8); got {w.dtype} {tuple(w.shape)}")
    w = w.contiguous()
    codes = torch.empty(n, k // 2, dtype=torch.uint8)
    scales = torch.empty(n, k // group_size, dtype=torch.bfloat16)
    zeros = None if symmetric else torch.empty_like(scales)
    deq = torch.empty(n, k, dtype=torch.float32) if dequantized else None
    _lib().qarl_quantize_u4(w.data_ptr(), n, k, k, group_size, int(symmetric), codes.data_ptr(),
                            scales.data_ptr(), _ptr(zeros), _ptr(deq), _threads())
    return codes, scales, zeros, deq


def round_bf16(x: Tensor) -> Tensor:
    """x.bfloat16().float() of a float32 CPU tensor in one pass (the rounding W4A16's kernel
    applies to its rows): the same bits for every non-NaN value; a NaN stays a NaN (its sign
    and payload kept, where torch writes one canonical NaN)."""
    if not x.is_cpu or x.dtype != torch.float32:
        raise ValueError(
            f"round_bf16 expects a float32 CPU tensor, got {x.dtype} on {x.device.type}")
    x = x.contiguous()
    out = torch.empty_like(x)
    _lib().qarl_round_bf16_row(x.data_ptr(), x.numel(), out.data_ptr())
    return out


def linear_u4(x: Tensor, w: PackedU4, round_bf16: bool = False) -> Tensor:
    """x [M, K] float32 -> x dequant(W)^T: [M, N] float32. round_bf16: x rounded to bf16 first
    (to nearest even, the same bits as x.bfloat16().float()), the A16 of W4A16."""
    x2 = _rows(x, torch.float32, w.k, "linear_u4")
    m = x2.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    _lib().qarl_linear_u4(x2.data_ptr(), m, w.k, w.k, w.data.data_ptr(), w.scales.data_ptr(),
                          _ptr(w.zeros), w.group_size, w.n, int(round_bf16), y.data_ptr(), w.n,
                          _threads())
    return y
