"""A preallocated key/value cache: one write per step, no reallocation while decoding."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(self, num_layers, batch_size, num_kv_heads, max_len, head_dim, dtype, device):
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, B, Hkv, S_max, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [layers, B, Hkv, S_max, D]
        self.max_len = max_len

    def update(self, layer: int, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Write k, v ([B, Hkv, T, D]) at slots start..start+T-1; return slots 0..start+T-1."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: writing slots up to {end}, cache holds {self.max_len}")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def reorder(self, index: Tensor) -> None:
        """Keep only rows `index` ([B'] int64), e.g. to drop finished sequences."""
        self.k = self.k[:, index]
        self.v = self.v[:, index]
