"""The loaded kernel library and the small helpers every wrapper uses."""

from __future__ import annotations

import torch
from torch import Tensor

from qarl.native.build import load, why_unavailable


def available() -> bool:
    return load() is not None


_LIB = []  # the loaded library, once: decoding calls the kernels several times per layer


def _lib():
    if _LIB:
        return _LIB[0]
    lib = load()
    if lib is None:
        raise RuntimeError(f"qarl's native CPU kernels are unavailable: {why_unavailable()}")
    _LIB.append(lib)
    return lib


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


def _rows(x: Tensor, dtype: torch.dtype, k: int, what: str) -> Tensor:
    # x [..., K] -> [M, K] contiguous CPU tensor of dtype (no copy when it already is one)
    if not x.is_cpu or x.dtype != dtype or x.shape[-1] != k:
        raise ValueError(
            f"{what} expects a CPU {dtype} input with {k} features, got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    if x.dim() == 2 and x.is_contiguous():
        return x
    return x.reshape(-1, k).contiguous()
