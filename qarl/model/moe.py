"""The sparse mixture-of-experts MLP of Qwen3-MoE, and routing control (record, replay).

A MoE layer replaces the dense MLP by E SwiGLU experts and a router (`mlp.gate`, a linear
hidden -> E). For each token x:
    p = softmax(gate(x))                       (fp32)
    S = the k experts of largest p             (top-k, k = num_experts_per_tok)
    w_e = p_e for e in S, divided by sum_{e in S} p_e when norm_topk_prob
    y = sum_{e in S} w_e * expert_e(x)
exactly as transformers' `Qwen3MoeSparseMoeBlock`. Parameter names are those of the HF
checkpoints on disk: `mlp.gate.weight` [E, d] and `mlp.experts.{e}.{gate,up,down}_proj.weight`.
Each expert is an ordinary `MLP` of three `nn.Linear`s, so `qarl.quant.quantize_model` swaps
them for `QuantLinear`s like any dense layer.

Dispatch (`dispatch`) groups the tokens by expert: one call of each expert that received
tokens, on all of its tokens at once (a Python loop over experts, never over tokens).

Routing control (`Routing`, `routing_scope`): a forward run inside `routing_scope(routing)`
writes every MoE layer's own top-k choice into `routing.chosen`, and, where `routing.replay`
holds expert ids, uses those experts instead (their weights still come from this router's
probabilities, so the router keeps its gradient). The rollout engine records what it chose
this way, and the learner replays it (routing replay, `quant.routing_replay`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from qarl.model.config import ModelConfig
from qarl.model.mlp import MLP


@dataclass
class Routing:
    """Routing of one forward: experts to use (`replay`) and the router's own choice (`chosen`)."""

    # [B, T, moe_layers, k] integer expert ids each token must use per MoE layer; -1 (the
    # whole k-row) = use the router's own top-k there. None: route normally everywhere.
    replay: Tensor | None = None
    chosen: dict[int, Tensor] = field(default_factory=dict)  # moe index -> [B, T, k] int64

    def chosen_experts(self, num_moe_layers: int) -> Tensor:  # [B, T, moe_layers, k] int16
        missing = [i for i in range(num_moe_layers) if i not in self.chosen]
        if missing:
            raise RuntimeError(f"MoE layers {missing} recorded no routing in this forward; "
                               f"record with routing_scope around one whole model forward")
        return torch.stack([self.chosen[i] for i in range(num_moe_layers)], dim=2).to(torch.int16)


_ROUTING: ContextVar[Routing | None] = ContextVar("qarl_moe_routing", default=None)


@contextmanager
def routing_scope(routing: Routing | None) -> Iterator[None]:
    """MoE layers run inside this block record into and replay from `routing`; None leaves
    whatever scope is already active."""
    if routing is None:
        yield
        return
    token = _ROUTING.set(routing)
    try:
        yield
    finally:
        _ROUTING.reset(token)


def route(router_logits: Tensor, top_k: int, norm_topk_prob: bool, forced: Tensor | None = None
          ) -> tuple[Tensor, Tensor, Tensor]:
    """router_logits [M, E] -> (weights [M, k] in the logits' dtype, experts [M, k] int64 used,
    own [M, k] int64 the router's top-k). `forced` [M, k] int: experts to use instead, -1 =
    the router's own there; forced experts are weighted by this router's probabilities."""
    # p = softmax(logits) in fp32; S = top-k of p; w = p_S, / sum(p_S) when norm_topk_prob
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [M, E]
    weights, own = torch.topk(probs, top_k, dim=-1)
    experts = own
    if forced is not None:
        experts = torch.where(forced >= 0, forced.long(), own)
        weights = probs.gather(1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts, own


def dispatch(x: Tensor, experts: Tensor, weights: Tensor, expert_fns: Sequence) -> Tensor:
    """y[m] = sum_j weights[m, j] * expert_fns[experts[m, j]](x[m]), tokens grouped by expert.

    x: [M, d]; experts: [M, k] int64; weights: [M, k] -> [M, d] in x's dtype. Each expert that
    received tokens runs once on all of them; contributions are added in expert order."""
    M, k = experts.shape
    out = torch.zeros_like(x)
    flat = experts.reshape(-1)  # [M k]
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens ascending in each
    counts = torch.bincount(flat, minlength=len(expert_fns)).tolist()
    flat_weights = weights.reshape(-1)  # [M k]
    for expert, slots in zip(expert_fns, order.split(counts)):
        if slots.numel() == 0:
            continue
        tokens = slots // k  # [n] token of each slot
        y = expert(x[tokens]) * flat_weights[slots, None]  # [n, d]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one decoder layer (the `moe_index`-th MoE layer of the model)."""

    def __init__(self, config: ModelConfig, moe_index: int):
        super().__init__()
        d, E = config.hidden_size, config.num_experts
        self.gate = nn.Linear(d, E, bias=False)  # the router
        self.experts = nn.ModuleList(MLP(d, config.moe_intermediate_size) for _ in range(E))
        self.top_k, self.norm_topk_prob, self.moe_index = (
            config.num_experts_per_tok, config.norm_topk_prob, moe_index)

    def forward(self, x: Tensor) -> Tensor:  # [B, T, d] -> [B, T, d]
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        routing = _ROUTING.get()
        forced = None if routing is None else self._forced(routing, B, T)
        weights, experts, own = route(self.gate(flat), self.top_k, self.norm_topk_prob, forced)
        if routing is not None:
            routing.chosen[self.moe_index] = own.view(B, T, self.top_k)
        return dispatch(flat, experts, weights, self.experts).view(B, T, d)

    def _forced(self, routing: Routing, B: int, T: int) -> Tensor | None:  # [B T, k] or None
        replay = routing.replay
        if replay is None:
            return None
        if replay.shape[:2] != (B, T) or replay.shape[3] != self.top_k:
            raise ValueError(
                f"routing replay of shape {list(replay.shape)} does not fit a forward of "
                f"[{B}, {T}] tokens with top-{self.top_k} routing; it must be [B, T, "
                f"moe_layers, {self.top_k}] for the same tokens")
        forced = replay[:, :, self.moe_index].reshape(B * T, self.top_k)
        if int(forced.max()) >= len(self.experts):
            raise ValueError(f"routing replay names expert {int(forced.max())}; this layer has "
                             f"{len(self.experts)} experts")
        return forced
