"""`Learner`: what the trainer asks of the learner, and `AlignedLearner`, the learner of one
process (or one replicated rank). Two verbs and what they hold:

- `replay(batch, sampling)`: old_logp, the learner's logprobs of the sampled tokens (no grad)
  by its value pass (`Passes.replay`: the engine's decode path, exact on CPU, or the
  teacher-forced forward under train.logp_path = 'forward');
- `update(experience, algo, train, step)`: the epochs of micro-batched backward passes and
  optimizer steps (`qarl.train.learner.update.update_policy`), returning the step's metrics;

plus `model` (the whole master weights: what the sync, evaluation and checkpoints read),
`optimizers`, `passes` (its passes and their `Precision`, which the run's start logs) and
`whole_optimizer_state()` (the block in which `optimizers` hold the whole optimizer state,
for a checkpoint).

With learner ranks each rank holds an `AlignedLearner` with its
`qarl.parallel.ranks.RankGroup` (`qarl.train.learner.follow`), and FSDP ranks an
`FsdpLearner`. A one-process learner is a world of one (`update.SOLO`), so the update has no
rank branch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import Tensor

from qarl.config import AlgoSection, TrainSection
from qarl.model import CausalLM
from qarl.train.learner.passes import Passes
from qarl.train.learner.update import SOLO, Collectives, update_policy
from qarl.train.phases import Experience
from qarl.types import RolloutBatch, SamplingParams


class Learner(Protocol):
    """What the trainer asks of the learner (module docstring)."""

    model: CausalLM  # the whole master weights (on FSDP rank 0: refreshed after each update)
    optimizers: list[torch.optim.Optimizer]
    passes: Passes

    def replay(self, batch: RolloutBatch, sampling: SamplingParams, for_update: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        """(old_logp [N, L] float32, the experts the learner's routers chose [N, P + L,
        moe_layers, k] int16 or None for a dense model). for_update: the old_logp phase of a
        step whose update of `batch` follows (`Passes.replay`)."""
        ...

    def update(self, exp: Experience, algo: AlgoSection, train: TrainSection,
               step: int) -> dict[str, float]:
        ...

    def whole_optimizer_state(self) -> contextlib.AbstractContextManager[None]:
        ...

    def release_caches(self) -> None:
        """Free what `replay` built for the current weights (`Engine.release_caches`)."""
        ...


class AlignedLearner:
    """The learner of one process (or one replicated rank, with its `group`): master weights
    in `passes.model` (QuantLinear layers in the align mode), trained by `optimizers`."""

    def __init__(self, passes: Passes, optimizers: list[torch.optim.Optimizer],
                 group: Collectives = SOLO):
        self.passes, self.optimizers, self.group = passes, optimizers, group
        self.model = passes.model

    def replay(self, batch: RolloutBatch, sampling: SamplingParams, for_update: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        return self.passes.replay(batch, sampling, for_update)

    def update(self, exp: Experience, algo: AlgoSection, train: TrainSection,
               step: int) -> dict[str, float]:
        return update_policy(self.passes, self.optimizers, self.group, exp, algo, train, step)

    def release_caches(self) -> None:
        self.passes.release_caches()

    @contextlib.contextmanager
    def whole_optimizer_state(self) -> Iterator[None]:
        yield  # a whole learner's optimizers always hold the whole state
