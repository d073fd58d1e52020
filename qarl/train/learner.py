"""`Learner`: the learner's one home. Three verbs and what they hold:

- `replay(batch, sampling)`: the learner's logprobs of the sampled tokens (no grad) by the
  engine's own decode path on the whole batch: exact on CPU, so old_logp equals the sampler's
  logprobs bit for bit under `kernel` alignment (`qarl.train.logprobs` says why this, and not
  a full-sequence forward); under `train.logp_path = 'forward'` (naive / fake alignment) by
  the teacher-forced forward instead (`logprobs.ForwardScorer`);
- `logprobs(batch, temperature)`: the fast teacher-forced forward, with grad
  (`logprobs.response_logprobs`), what the update's gradient comes from;
- `update(experience, algo, train, step)`: the epochs of micro-batched backward passes and
  optimizer steps (`qarl.train.update.update_policy`), returning the step's metrics;

plus `model` (the whole master weights: what the sync, evaluation and checkpoints read),
`optimizers`, and `whole_optimizer_state()` (the block in which `optimizers` hold the whole
optimizer state, for a checkpoint).

`AlignedLearner` is the one-process learner; with learner ranks each rank holds one with its
`qarl.parallel.ranks.RankGroup` (`qarl.train.follow`), and FSDP ranks an `FsdpLearner`. A
one-process learner is a world of one (`update.SOLO`), so the update has no rank branch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import Tensor

from qarl.config import AlgoSection, TrainSection
from qarl.model import CausalLM
from qarl.rollout import LocalEngine
from qarl.train.logprobs import ForwardScorer, response_logprobs
from qarl.train.phases import Experience
from qarl.train.precision import resolve_compute_dtype
from qarl.train.update import SOLO, Collectives, forward_ahead, update_policy
from qarl.types import RolloutBatch, SamplingParams


class Learner(Protocol):
    """What the trainer asks of the learner (module docstring)."""

    model: CausalLM  # the whole master weights (on FSDP rank 0: refreshed after each update)
    optimizers: list[torch.optim.Optimizer]

    def replay(self, batch: RolloutBatch, sampling: SamplingParams, for_update: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        """(old_logp [N, L] float32, the experts the learner's routers chose [N, P + L,
        moe_layers, k] int16 or None for a dense model). for_update: the old_logp phase of a
        step whose update of `batch` follows (a learner may run that update's first forward
        now and read its values: `AlignedLearner`)."""
        ...

    def logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[Tensor, Tensor]:
        """(logp [N, L] float32 with grad, entropy [N, L]) by the fast forward."""
        ...

    def update(self, exp: Experience, algo: AlgoSection, train: TrainSection,
               step: int) -> dict[str, float]:
        ...

    def whole_optimizer_state(self) -> contextlib.AbstractContextManager[None]:
        ...

    def release_caches(self) -> None:
        """Free what `replay` built for the current weights (`Engine.release_caches`)."""
        ...


def later_logp(learner: AlignedLearner, exp: Experience, rows: range) -> Tensor:
    """logp's value at an optimizer step after the first, for that step's `rows` ([N, L]
    float32; only `rows` are read), on an AlignedLearner or an FsdpLearner's rank 0 (both
    hold `replayer`, `replay` and `routing_replay`): the learner's decode-path replay of the
    whole batch (the shape it was sampled with), or the forward of the micro-batches that
    hold `rows`, each split as old_logp's was (a ForwardScorer: train.logp_path)."""
    replayer = learner.replayer
    if isinstance(replayer, ForwardScorer):
        return replayer.score_part(exp.batch, exp.sampling, rows, learner.routing_replay)
    return learner.replay(exp.batch, exp.sampling)[0]


def own_forward_values(learner: AlignedLearner, train: TrainSection) -> bool:
    """Whether an optimizer step after the first takes logp's value from its own gradient
    forward: where `learner`'s logp values come from a ForwardScorer whose bits that forward
    computes (`ForwardScorer.is_gradient_pass`), a second forward without grad would repeat
    it (TRL likewise reads the training forward's logprobs)."""
    if not isinstance(learner, AlignedLearner):
        return False  # an FSDP rank's forward runs on shards: rank 0 scores again
    replayer = learner.replayer
    compute = resolve_compute_dtype(train.compute_dtype, next(learner.model.parameters()).device)
    return (isinstance(replayer, ForwardScorer)
            and replayer.is_gradient_pass(compute, train.micro_batch_size))


@dataclass
class _Ahead:
    """The update's first gradient forward, run by the old_logp phase of `batch`."""

    batch: RolloutBatch
    forward: tuple[Tensor, Tensor]  # (logp [n, L] with grad, entropy [n, L])


class AlignedLearner:
    """The learner of one process (or one replicated rank, with its `group`): master weights
    in `model` (QuantLinear layers in the align mode), trained by `optimizers`; `replayer` is
    the engine's decode path around `model` (a LocalEngine), or its teacher-forced forward (a
    ForwardScorer: train.logp_path); `routing_replay`: MoE layers use the engine's experts
    (quant.routing_replay); `train`: the recipe's [train] (lets the old_logp phase run the
    update's first forward: `replay`)."""

    def __init__(self, model: CausalLM, optimizers: list[torch.optim.Optimizer],
                 replayer: LocalEngine | ForwardScorer, routing_replay: bool = False,
                 group: Collectives = SOLO, train: TrainSection | None = None):
        self.model, self.optimizers, self.replayer = model, optimizers, replayer
        self.routing_replay, self.group, self.train = routing_replay, group, train
        self._ahead: _Ahead | None = None

    def replay(self, batch: RolloutBatch, sampling: SamplingParams, for_update: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        """for_update, where the update's gradient forward computes the scorer's bits
        (`reads_ahead`): the first micro-batch's old_logp are the values of that forward, run
        now with grad and kept for the update's first optimizer step (`update.forward_ahead`;
        TRL likewise reads old_logp from the training forward), and only the other rows are
        scored without grad. The same bits as a replay of every row, one micro-batch's
        forward fewer: with one micro-batch per step, no scoring pass at all."""
        self._ahead = None  # a forward kept for a batch whose update never came
        if not (for_update and torch.is_grad_enabled() and self.reads_ahead()):
            return self.replayer.score_routing(batch, sampling, replay=self.routing_replay)
        ahead = forward_ahead(self.model, batch, sampling, self.train)
        first = ahead[0].shape[0]
        logp = self.replayer.score_part(batch, sampling, range(first, batch.num_sequences))
        logp[:first] = ahead[0].detach()
        self._ahead = _Ahead(batch, ahead)
        return logp, None

    def reads_ahead(self) -> bool:
        """Whether `replay(for_update=True)` runs the update's first forward: one process (a
        rank's update splits its micro-batches with the others), logp values by a
        ForwardScorer whose bits the gradient forward computes (`own_forward_values`), no
        routing replay (the scorer keeps no routing table either)."""
        return (self.train is not None and self.group is SOLO and not self.routing_replay
                and own_forward_values(self, self.train))

    def logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[Tensor, Tensor]:
        return response_logprobs(self.model, batch, temperature,
                                 routing_replay=self.routing_replay)

    def update(self, exp: Experience, algo: AlgoSection, train: TrainSection,
               step: int) -> dict[str, float]:
        exact = None if own_forward_values(self, train) else partial(later_logp, self)
        ahead, self._ahead = self._ahead, None
        forward = ahead.forward if ahead is not None and ahead.batch is exp.batch else None
        return update_policy(self.model, self.optimizers, self.group, exact, exp, algo, train,
                             step, self.routing_replay, forward)

    def release_caches(self) -> None:
        self.replayer.release_caches()

    @contextlib.contextmanager
    def whole_optimizer_state(self) -> Iterator[None]:
        yield  # a whole learner's optimizers always hold the whole state
