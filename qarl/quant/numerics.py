"""Quantizer primitives: the only place where codes and scales are computed.

Every function here is pure (no state, no config, no I/O). The kernel path, the `fake`
emulation and the exported checkpoint all call these, so the learner and the engine can never
disagree on a code or a scale.

Conventions (rows are output channels of a weight [N, K], or tokens of an activation [M, K]):
- int8, symmetric per row:  s = max|x| / 127,  q = clamp(round(x / s), -127, 127)   (vLLM W8A8)
- fp8 E4M3, per row:        s = max(max|x| / 448, 1 / (448 * 512)),  q = fp8(x / s)  (vLLM)
- fp8 E4M3, 2-D blocks:     same per [bn, bk] tile (weights 128x128, activations 1x128)
- int4 groups along K:      symmetric  s = bf16(max|x| / 7.5), q = clamp(round(x / s), -8, 7)
                            asymmetric s = bf16((max - min) / 15), z = bf16(min + 8 s),
                                       q = clamp(round((x - z) / s), -8, 7);  x ~ q s + z
                            stored as u = q + 8 in [0, 15] (the CPU int4 kernel's layout)
- NVFP4: E2M1 values {0, .5, 1, 1.5, 2, 3, 4, 6}, one E4M3 scale per 16 values, one fp32
  global scale g = 448 * 6 / max|w|:  s_b = e4m3(max|w_b| / 6 * g),  x ~ e2m1 * (s_b / g)
`round` is round-half-to-even everywhere (torch.round, the fp8 cast, the E2M1 rounding).
"""

from __future__ import annotations

import torch
from torch import Tensor

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor on dynamic fp8 scales
FP4_MAX = 6.0  # largest E2M1 value
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # code & 7 -> magnitude


def int8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [R, K] float -> codes [R, K] int8, scales [R] float32 (one per row)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # [R]
    # s = max|x| / 127 (an all-zero row gets s = 1 so its codes are 0, not NaN)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    codes = torch.round(xf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [R, K] float -> codes [R, K] float8_e4m3fn, scales [R] float32 (one per row)."""
    xf = x.float()
    # s = max(max|x| / 448, 1 / (448 * 512)), q = fp8(x / s) with PyTorch's own cast (RNE)
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)  # [R]
    codes = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def pad_to(x: Tensor, rows: int, cols: int) -> Tensor:
    """Zero-pad a 2-D tensor at the bottom/right to [rows, cols] (no copy if already there)."""
    r, c = x.shape
    if r == rows and c == cols:
        return x
    return torch.nn.functional.pad(x, (0, cols - c, 0, rows - r))


def fp8_blocks(x: Tensor, block_rows: int, block_cols: int) -> tuple[Tensor, Tensor]:
    """x [R, K] -> codes [R, K] float8_e4m3fn, scales [ceil(R/br), ceil(K/bc)] float32.

    A ragged last block is scaled by the max over its real elements (zero padding never wins
    the max), as in DeepSeek-V3 / vLLM block FP8.
    """
    R, K = x.shape
    nr, nc = -(-R // block_rows), -(-K // block_cols)
    xp = pad_to(x.float(), nr * block_rows, nc * block_cols)
    tiles = xp.view(nr, block_rows, nc, block_cols)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(FP8_MIN_SCALE)  # [nr, nc]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    codes = q.view(nr * block_rows, nc * block_cols)[:R, :K].to(torch.float8_e4m3fn)
    return codes, scale


def expand_blocks(scale: Tensor, block_rows: int, block_cols: int, rows: int, cols: int) -> Tensor:
    """[nr, nc] per-block values -> [rows, cols] per-element values (ragged edge cropped)."""
    full = scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return full[:rows, :cols]


def check_groups(K: int, group_size: int, what: str) -> None:
    if group_size <= 0 or K % group_size:
        raise ValueError(
            f"{what}: group size {group_size} does not divide the input dimension K={K}; "
            f"choose a group size that divides K (divisors among 16/32/64/128: "
            f"{[g for g in (16, 32, 64, 128) if K % g == 0]})"
        )


def int4_groups(w: Tensor, group_size: int, symmetric: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """w [N, K] -> u [N, K] uint8 in [0, 15], scales [N, K/g] bf16, zeros [N, K/g] bf16 | None.

    Dequantized value: (u - 8) * s (+ z when asymmetric). Scales and zeros are rounded to bf16
    before the codes are computed, because the CPU int4 kernel reads them in bf16.
    """
    N, K = w.shape
    check_groups(K, group_size, "int4 weight")
    g = w.float().reshape(N, K // group_size, group_size)  # [N, G, g]
    if symmetric:
        # s = bf16(max|w| / 7.5), q = clamp(round(w / s), -8, 7)
        s = (g.abs().amax(-1) / 7.5).bfloat16()
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(g / s.float()[..., None]).clamp(-8, 7)
        z = None
    else:
        # s = bf16((max - min) / 15), z = bf16(min + 8 s), q = clamp(round((w - z) / s), -8, 7)
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15.0).bfloat16()
        s = torch.where(s > 0, s, torch.ones_like(s))
        z = (lo + 8.0 * s.float()).bfloat16()
        q = torch.round((g - z.float()[..., None]) / s.float()[..., None]).clamp(-8, 7)
    u = (q + 8).to(torch.uint8).reshape(N, K)
    return u, s, z


def int4_dequantize(u: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int) -> Tensor:
    """u [N, K] uint8, scales/zeros [N, K/g] -> w [N, K] float32 = (u - 8) * s (+ z)."""
    N, K = u.shape
    q = (u.float() - 8.0).reshape(N, K // group_size, group_size)
    w = q * scales.float()[..., None]
    if zeros is not None:
        w = w + zeros.float()[..., None]
    return w.reshape(N, K)


def e2m1_encode(x: Tensor) -> Tensor:
    """x float (already divided by its scale) -> uint8 FP4 codes (bit 3 sign, bits 0-2 E2M1).

    Round to nearest, ties to the even code: the midpoints 0.25, 1.25, 2.5, 5 round down and
    0.75, 1.75, 3.5 round up; magnitudes above 6 saturate to 6.
    """
    a = x.abs()
    idx = (
        (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
        + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    )
    sign = ((x < 0) & (idx > 0)).to(torch.uint8) << 3
    return sign | idx.to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 FP4 codes -> float32 E2M1 values."""
    mag = E2M1_VALUES.to(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -mag, mag)


def nvfp4(w: Tensor, block: int = 16, amax: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """w [N, K] -> codes [N, K] uint8 (FP4), scales [N, K/16] float8_e4m3fn, global [] fp32.
    `amax` (>= max|w|) replaces max|w| in the global scale: the largest of a fused group's
    weights, so the group shares one global scale (see Nvfp4Scheme)."""
    N, K = w.shape
    check_groups(K, block, "nvfp4 weight")
    wf = w.float()
    amax = wf.abs().amax() if amax is None else amax.float()
    # g = 448 * 6 / max|w| (compressed-tensors' weight_global_scale; the decode divides by it)
    glob = torch.where(amax > 0, (FP8_MAX * FP4_MAX) / amax, torch.ones_like(amax))
    blocks = wf.reshape(N, K // block, block)
    # s_b = e4m3(max|w_b| / 6 * g) <= 448 by construction
    s = (blocks.abs().amax(-1) / FP4_MAX * glob).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    eff = s.float() / glob  # [N, K/16] effective per-block scale
    safe = torch.where(eff > 0, eff, torch.ones_like(eff))
    codes = e2m1_encode(blocks / safe[..., None]).reshape(N, K)
    return codes, s, glob


def nvfp4_dequantize(codes: Tensor, scales: Tensor, glob: Tensor, block: int = 16) -> Tensor:
    """codes [N, K] uint8, scales [N, K/16] e4m3, glob [] -> w [N, K] float32."""
    N, K = codes.shape
    eff = scales.float() / glob  # same expression as in nvfp4()
    return (e2m1_decode(codes).reshape(N, K // block, block) * eff[..., None]).reshape(N, K)


def pack_nibbles(u: Tensor) -> Tensor:
    """[N, K] uint8 values in [0, 15] -> [N, K/2] uint8, element 2i in the low nibble."""
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_nibbles(p: Tensor) -> Tensor:
    """[N, K/2] uint8 -> [N, K] uint8 (inverse of pack_nibbles)."""
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1)
