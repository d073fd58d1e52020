"""The engine's routing table: which experts each token went to, in every MoE layer.

While the engine runs a MoE model (`qarl.model.moe`), each forward of the decode plan runs
inside a `Routing` scope: the routers' own top-k lands in the table at the tokens' rows and
columns, and, when scoring with routing replay, the table given in is what the routers use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from qarl.model.decoder import CausalLM
from qarl.model.moe import Routing, routing_scope


class RoutingTable:
    """[N, S, moe_layers, k] int16 expert ids of N sequences over S columns (-1: no token ran
    there, or its output is never used); `table` is None for a dense model."""

    def __init__(self, model: CausalLM, N: int, S: int, replay: Tensor | None = None):
        config = model.config
        self.num_moe = len(config.moe_layers)
        self.table = None
        if self.num_moe:
            k = config.num_experts_per_tok
            self.table = torch.full((N, S, self.num_moe, k), -1, dtype=torch.int16,
                                    device=model.model.embed_tokens.weight.device)
        if replay is not None and (self.table is None or replay.shape != self.table.shape):
            raise ValueError(
                f"routing replay of shape {None if replay is None else list(replay.shape)} does "
                f"not fit this batch and model (expects "
                f"{None if self.table is None else list(self.table.shape)}); pass the "
                f"routed_experts of a batch this model's engine generated")
        self.replay = replay  # [N, S, moe_layers, k] or None

    @contextmanager
    def record(self, rows: Tensor, start: int, valid: Tensor) -> Iterator[None]:
        """A forward of cache rows `rows` ([B] int64 original rows) over columns start..start+T-1
        in this block is recorded (and replayed); valid [B, T] bool marks tokens whose
        routing counts."""
        if self.table is None:
            yield
            return
        T = valid.shape[1]
        replay = None if self.replay is None else self.replay[rows, start:start + T]
        routing = Routing(replay=replay)
        with routing_scope(routing):
            yield
        chosen = routing.chosen_experts(self.num_moe)  # [B, T, moe_layers, k]
        self.table[rows, start:start + T] = chosen.masked_fill(~valid[:, :, None, None], -1)
