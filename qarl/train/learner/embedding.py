"""A learner's token embedding whose weight the lm_head shares (tied), with its gradient
added into the weight's gradient as the rows it looked up.

Autograd's embedding backward makes a dense [vocab, hidden] tensor of zeros, adds the rows the
forward looked up, and sums it with the weight's other gradients (the tied lm_head's): two
passes over the vocabulary's weights per embedding call, and a micro-batch's gradient forward
has two calls (its prompts, its responses: `logprobs._predicting_hidden`). A sparse gradient
does not help: autograd adds it to the lm_head's dense one out of place, a copy of the same
size. `RowsEmbedding` keeps each call's (ids, row gradients) instead and adds them, in place,
into the weight's gradient once autograd has accumulated the lm_head's there (a
post-accumulate-grad hook): the same sum in another order (benchmarks/roofline.py measures the
update). Only a tied weight takes it: the lm_head's gradient is what makes autograd run the
weight's accumulation, and so the hook, at every backward.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _Rows(torch.autograd.Function):
    """F.embedding(ids, weight) whose backward hands the row gradients to `pending` and gives
    the weight none through autograd."""

    @staticmethod
    def forward(ctx, weight: Tensor, ids: Tensor, pending: list) -> Tensor:
        ctx.ids, ctx.pending = ids, pending
        return F.embedding(ids, weight)  # [..., H]

    @staticmethod
    def backward(ctx, grad: Tensor):  # grad [..., H]
        ctx.pending.append((ctx.ids.reshape(-1), grad.reshape(-1, grad.shape[-1])))
        return None, None, None


class RowsEmbedding(nn.Embedding):
    """nn.Embedding over a tied `weight` (the same Parameter, so the tie, the state_dict names
    and the optimizer's parameter stay) whose gradient rows go straight into weight.grad
    (module docstring) while `on`; plain nn.Embedding otherwise."""

    def __init__(self, weight: nn.Parameter):
        super().__init__(*weight.shape, device="meta", dtype=weight.dtype)
        self.weight = weight  # the Parameter itself: nn.Embedding's own would wrap a new one
        self.on = True
        self.pending: list[tuple[Tensor, Tensor]] = []  # (ids [n], rows [n, H]) per call
        # the weight whose gradient takes the rows: hooks stay with a tensor, not its copies,
        # so a deep copy of the model (a weakref copies as itself) hooks its own weight anew
        self._hooked: weakref.ref | None = None

    def forward(self, ids: Tensor) -> Tensor:  # ids [...] -> [..., H]
        if self.on and torch.is_grad_enabled() and self.weight.requires_grad:
            if self._hooked is None or self._hooked() is not self.weight:
                self.weight.register_post_accumulate_grad_hook(self._add_rows)
                self._hooked = weakref.ref(self.weight)
            return _Rows.apply(self.weight, ids, self.pending)
        return super().forward(ids)

    def _add_rows(self, weight: Tensor) -> None:
        with torch.no_grad():
            while self.pending:
                ids, rows = self.pending.pop()
                weight.grad.index_add_(0, ids, rows.to(weight.grad.dtype))


def rows_into_gradient(model: nn.Module, on: bool) -> bool:
    """Give a tied learner `model` a `RowsEmbedding` (once) and turn it on or off (off: learner
    ranks, whose collectives run on the weights' own gradient path); -> whether it is on. A
    model whose embedding is not tied to its lm_head, or is frozen, keeps autograd's
    embedding."""
    body = getattr(model, "model", None)
    embed = getattr(body, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if not isinstance(embed, nn.Embedding) or getattr(head, "weight", None) is not embed.weight:
        return False
    if not embed.weight.requires_grad:  # a frozen base (LoRA): no gradient to add to
        if isinstance(embed, RowsEmbedding):
            embed.on = False
        return False
    if not isinstance(embed, RowsEmbedding):
        if not on:  # never a new module once others hold this one (FSDP's shards do)
            return False
        if embed.padding_idx is not None or embed.max_norm is not None or embed.sparse:
            return False  # options F.embedding's plain call would drop
        embed = body.embed_tokens = RowsEmbedding(embed.weight)
    embed.on = on
    return on
