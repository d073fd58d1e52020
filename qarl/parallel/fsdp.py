"""FSDP2 learner ranks (`dist.learner_strategy = "fsdp"`): weights, gradients and optimizer
state sharded over the ranks.

With "replicate" (the default, `qarl.parallel.ranks`) every rank holds the whole learner and
its optimizer state, and the gradients are all-reduced. With "fsdp" each rank holds 1/M of every
parameter, of its gradient and of AdamW's moments: `torch.distributed.fsdp.fully_shard` on
every decoder block and on the root, so a block's weights are gathered for its forward and
backward only, and the backward reduce-scatters the gradients, SUMMED (not averaged: the loss
is already normalized by the whole batch's counts, `global_counts`). Micro-batch j still runs
on rank j mod M, so the gradients are those of the replicated ranks.

The other ranks start from a skeleton (`qarl.model.load_skeleton`, on the meta device): only
their shards are ever allocated, filled from rank 0 (`ShardedLearner.load`).
Rank 0 keeps its whole learner (`qarl.train.learner.follow.FsdpLearner.model`: no gradients, no
optimizer state) for what reads whole weights: the old_logp replay, the weight sync,
evaluation and checkpoints. After
every update the shards are gathered into it (`ShardedLearner.publish`, a collective: rank 0
receives, the others send). Its optimizer objects hold state only while a checkpoint is
written (`full_optimizer_state`), in the layout a one-rank run writes, so a run can resume
with any strategy or number of ranks.

What else changes with "fsdp": forward and backward are collectives, so every rank runs the
same number of micro-batches (the config asks micro-batches per step to be a multiple of the
ranks) and a non-finite loss does not end one rank's epoch early (every rank runs its backward;
the step is dropped as before); later epochs' replays run on rank 0 and are broadcast. Refused
at load (`qarl.config`): Muon (it orthogonalizes whole matrices, not shards) and
mixture-of-experts models (an expert unused on one rank has no gradient to reduce-scatter).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from collections.abc import Callable

from qarl.model import CausalLM
from qarl.quant import quant_layers

_TO_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets the whole
_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
_WHOLE = StateDictOptions(full_state_dict=True)  # an unsharded model's state, as it is


def shard_model(model: CausalLM) -> CausalLM:
    """`model`, in place, as FSDP2 modules: one per decoder block, and the root (embeddings,
    final norm, lm_head). Gradients are summed over the ranks."""
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    for module in (*model.model.layers, model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum
    return model


class ShardedLearner:
    """This rank's shards of the learner and its optimizers."""

    def __init__(self, model: CausalLM, optimizers: Callable[[CausalLM], list]):
        """`model`: whole, or a skeleton on the meta device (`qarl.model.load_skeleton`:
        its shards are allocated here and filled by `load`); `optimizers(module)` builds the
        run's optimizers over the sharded module."""
        self.model = shard_model(model)
        if any(p.is_meta for p in self.model.parameters()):
            self.model.to_empty(device="cpu")
        self.optimizers = optimizers(self.model)
        for opt in self.optimizers:  # stepped shards are gathered into a reused buffer
            opt.register_step_post_hook(lambda *_: self.forget())

    def load(self, learner: CausalLM | None, optimizers: list | None, stepped: bool) -> None:
        """Collective: every rank's shards from rank 0's whole `learner` and, when `stepped`
        (rank 0's optimizers hold state: a resumed run; the same flag on every rank), its
        `optimizers` (both None on the other ranks)."""
        set_model_state_dict(self.model, learner.state_dict() if learner is not None else {},
                             options=_FROM_RANK0)
        if stepped:
            state = (get_optimizer_state_dict(learner, optimizers, options=_WHOLE)
                     if learner is not None else {})
            set_optimizer_state_dict(self.model, self.optimizers, state, options=_FROM_RANK0)
        self.forget()

    def stepped(self) -> bool:
        """Whether the optimizers hold state (the same on every rank: they step together).
        torch's state-dict helpers give a state-less optimizer state by taking a zero step,
        which would count in AdamW's bias correction: a state-less one is left as it is."""
        return any(opt.state for opt in self.optimizers)

    def publish(self, into: CausalLM | None) -> None:
        """Collective: rank 0's whole learner `into` takes the current weights (None on the
        other ranks, which only send their shards)."""
        state = get_model_state_dict(self.model, options=_TO_RANK0)
        if into is not None:
            with torch.no_grad():
                for name, p in into.named_parameters():
                    p.copy_(state[name])

    def full_optimizer_state(self, learner: CausalLM | None, optimizers: list | None) -> None:
        """Collective: rank 0's `optimizers` (over its whole `learner`) take the shards' state;
        none before the first optimizer step, as in a one-rank run."""
        if not self.stepped():
            return
        state = get_optimizer_state_dict(self.model, self.optimizers, options=_TO_RANK0)
        if learner is not None:
            set_optimizer_state_dict(learner, optimizers, state, options=_WHOLE)

    def forget(self) -> None:
        """Drop every quantized-weight cache (QuantLinear.forget): the next forward quantizes
        the gathered weights again."""
        for layer in quant_layers(self.model).values():
            layer.forget()


def clear_state(optimizers: list) -> None:
    """Free rank 0's whole optimizer state (the shards hold it)."""
    for opt in optimizers:
        opt.state.clear()
