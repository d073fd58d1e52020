"""Passes over a tensor's raw bytes for the weight sync (bytes.c): `crc32`, zlib's CRC-32
folded with carry-less multiplies, and `count_changed_bytes`. Both release the GIL (ctypes),
so threads hash or compare tensors side by side. Each has the same value as its portable
form (`zlib.crc32`, `torch.count_nonzero` of the difference); callers take those where the
native kernels are unavailable (`qarl.native.available()`)."""

from __future__ import annotations

import torch
from torch import Tensor

from qarl.native.ffi import _lib, _threads


def _bytes(t: Tensor, what: str) -> Tensor:
    if not t.is_cpu:
        raise ValueError(f"{what} reads CPU tensors; got one on {t.device}")
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def crc32(t: Tensor, crc: int = 0) -> int:
    """`zlib.crc32(t's bytes, crc)`: the same value, for any dtype and length."""
    data = _bytes(t, "crc32")
    return int(_lib().qarl_crc32(data.data_ptr(), data.numel(), crc & 0xFFFFFFFF))


def count_changed_bytes(a: Tensor, b: Tensor) -> int:
    """The number of byte positions at which a and b (the same number of bytes) differ."""
    x, y = _bytes(a, "count_changed_bytes"), _bytes(b, "count_changed_bytes")
    if x.numel() != y.numel():
        raise ValueError(f"count_changed_bytes compares equal sizes; got {x.numel()} and "
                         f"{y.numel()} bytes")
    return int(_lib().qarl_count_changed_bytes(x.data_ptr(), y.data_ptr(), x.numel(),
                                               _threads()))
