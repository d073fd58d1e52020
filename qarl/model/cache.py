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


class SharedPrefixCache:
    """Keys and values of prompts that several rows share, kept with their autograd graph: the
    learner's gradient pass runs each distinct prompt once (`fill`: cache_start 0, one row per
    prompt), then every row's continuation against its prompt's keys and values (`attend`:
    cache_start = the prompt width, `rows[b]` = the prompt of row b). The same attention as
    one pass over prompt + continuation, without computing a prompt once per row; gradients
    from every row that shares a prompt sum into it."""

    def __init__(self, rows: Tensor):  # [B] int64: the prompt (fill row) of each attend row
        self.rows = rows
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}

    def update(self, layer: int, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        if start == 0:  # fill: [G, Hkv, P, D]
            self.k[layer], self.v[layer] = k, v
            return k, v
        # attend: [B, Hkv, T, D] after this layer's prompt keys of each row -> [B, Hkv, P+T, D]
        width = self.k[layer].shape[2]
        if start != width:
            raise ValueError(f"SharedPrefixCache: continuation starts at slot {start}, the "
                             f"prompts fill {width}")
        return (torch.cat([self.k[layer].index_select(0, self.rows), k], dim=2),
                torch.cat([self.v[layer].index_select(0, self.rows), v], dim=2))
