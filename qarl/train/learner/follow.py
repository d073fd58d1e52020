"""The learner on several ranks (`dist.learner_ranks = M > 1`): rank 0's learner, the FSDP
learner, and the body every follower rank runs (`python -m qarl.train.learner.follow`, or a
Ray actor).

The trainer is rank 0. `learner_on_ranks` starts ranks 1..M-1 (`qarl.parallel.launch`, handed
`follow` as their body), shares rank 0's weights and optimizer state with them (once, after
any warm start or resume), and gives the trainer a `LeadLearner`: the same `Learner` as in
one process, whose `update` first sends the step's `Experience` to every rank. Each follower
builds the learner as the trainer does (`qarl.train.policy.learner_model`; a meta-device
skeleton under FSDP) and then follows rank 0's messages: ("update", experience, step) ->
`learner.update` on its share of the micro-batches; ("optimizer_state",) -> the whole
optimizer state gathered to rank 0 for a checkpoint (FSDP); None -> stop. Rank 0 alone
generates, scores rewards, syncs the engine and writes checkpoints.

- `dist.learner_strategy = "replicate"`: every rank holds an `AlignedLearner` with its
  `RankGroup`; gradients are summed by an all-reduce and every rank steps its whole copy.
- "fsdp": every rank holds an `FsdpLearner` over its shards (`qarl.parallel.fsdp`); rank 0
  also keeps whole weights (no gradients, no optimizer state) for replay, sync, evaluation
  and checkpoints, refreshed from the shards after each update.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

from torch import Tensor

from qarl.config import AlgoSection, RunConfig, TrainSection
from qarl.model import DTYPES, CausalLM, load_model, load_skeleton, load_tokenizer
from qarl.parallel.fsdp import ShardedLearner, clear_state
from qarl.parallel.launch import Follower, follower_main, learner_ranks
from qarl.parallel.ranks import LearnerRankDied, RankGroup, join_group, leave_group, share_state
from qarl.train.learner.learner import AlignedLearner, Learner
from qarl.train.learner.optim import build_optimizer
from qarl.train.learner.passes import Passes
from qarl.train.learner.precision import Precision
from qarl.train.learner.update import update_policy
from qarl.train.phases import Experience
from qarl.train.policy import learner_model, make_replayer
from qarl.types import RolloutBatch, SamplingParams


class ShardedPasses(Passes):
    """An FSDP rank's passes: the gradient forward on its shards; a later optimizer step's logp
    value by rank 0's whole learner (`whole`, its passes; the shards gathered into it first),
    broadcast to every rank. None reads ahead: the gradient forward runs on shards."""

    def __init__(self, sharded: ShardedLearner, group: RankGroup, whole: Passes | None,
                 precision: Precision, train: TrainSection, routing_replay: bool):
        super().__init__(sharded.model, None, precision, train, routing_replay, solo=False)
        self.sharded, self.group, self.whole = sharded, group, whole

    def later(self, exp: Experience, rows: range) -> Tensor:
        self.sharded.publish(None if self.whole is None else self.whole.model)
        logp = None if self.whole is None else self.whole.values(exp, rows)
        return self.group.broadcast(logp)


class FsdpLearner:
    """One rank's FSDP learner: trains its shards (`passes.sharded`); on rank 0 also the whole
    learner (`whole`: its passes, whose model is `model` there) and its (state-free)
    optimizers, which hold the whole state only inside `whole_optimizer_state`."""

    def __init__(self, passes: ShardedPasses, optimizers: list | None = None):
        self.passes, self.sharded, self.whole = passes, passes.sharded, passes.whole
        self.model = self.whole.model if self.whole is not None else self.sharded.model
        self.optimizers = optimizers or []

    def replay(self, batch: RolloutBatch, sampling: SamplingParams, for_update: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        # every row scored: the gradient forward runs on shards, split among the ranks
        return self.whole.replay(batch, sampling)

    def update(self, exp: Experience, algo: AlgoSection, train: TrainSection,
               step: int) -> dict[str, float]:
        metrics = update_policy(self.passes, self.sharded.optimizers, self.passes.group, exp,
                                algo, train, step)
        # rank 0 receives the stepped shards, the others send
        self.sharded.publish(None if self.whole is None else self.whole.model)
        return metrics

    def release_caches(self) -> None:
        if self.whole is not None:
            self.whole.release_caches()

    @contextlib.contextmanager
    def whole_optimizer_state(self) -> Iterator[None]:
        """Collective: the shards' optimizer state gathered into rank 0's optimizers, freed after."""
        whole = None if self.whole is None else self.whole.model
        self.sharded.full_optimizer_state(whole, self.optimizers if whole is not None else None)
        try:
            yield
        finally:
            clear_state(self.optimizers)


class LeadLearner:
    """Rank 0's learner with followers: `inner`'s, each update and checkpoint gather first
    announced to the other ranks."""

    def __init__(self, inner: Learner, group: RankGroup):
        self.inner, self.group = inner, group
        self.model, self.optimizers, self.passes = inner.model, inner.optimizers, inner.passes

    def replay(self, batch: RolloutBatch, sampling: SamplingParams, for_update: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        return self.inner.replay(batch, sampling, for_update)

    def update(self, exp: Experience, algo: AlgoSection, train: TrainSection,
               step: int) -> dict[str, float]:
        self.group.broadcast(("update", exp, step))
        return self.inner.update(exp, algo, train, step)

    def release_caches(self) -> None:
        self.inner.release_caches()

    @contextlib.contextmanager
    def whole_optimizer_state(self) -> Iterator[None]:
        self.group.broadcast(("optimizer_state",))
        with self.inner.whole_optimizer_state():
            yield


def _optimizers(config: RunConfig):
    train = config.train
    return lambda module: build_optimizer(module, train.optimizer, train.lr, train.weight_decay,
                                          tuple(train.betas))


def _fsdp_learner(config: RunConfig, group: RankGroup, model: CausalLM,
                  whole: AlignedLearner | None) -> FsdpLearner:
    """Shard `model` (rank 0: a copy of its whole learner's; the others: their skeleton) and
    fill the shards from rank 0 (collective)."""
    sharded = ShardedLearner(model, _optimizers(config))
    stepped = group.broadcast(any(opt.state for opt in whole.optimizers) if whole else None)
    sharded.load(whole.model if whole else None, whole.optimizers if whole else None, stepped)
    precision = Precision.of(config.train, config.quant)
    passes = ShardedPasses(sharded, group, whole.passes if whole else None, precision,
                           config.train, config.quant.routing_replay)
    if whole is None:
        return FsdpLearner(passes)
    clear_state(whole.optimizers)  # the shards hold it
    return FsdpLearner(passes, whole.optimizers)


def lead(config: RunConfig, group: RankGroup, learner: AlignedLearner) -> LeadLearner:
    """Rank 0's learner over joined ranks: `learner`'s state shared with every follower."""
    if config.dist.learner_strategy == "fsdp":
        return LeadLearner(_fsdp_learner(config, group, copy.deepcopy(learner.model), learner), group)
    share_state(group, learner.model, learner.optimizers)
    solo = learner.passes
    passes = Passes(solo.model, solo.replayer, solo.precision, config.train, solo.routing_replay,
                    solo=False)
    return LeadLearner(AlignedLearner(passes, learner.optimizers, group), group)


@contextlib.contextmanager
def learner_on_ranks(config: RunConfig, learner: AlignedLearner) -> Iterator[Learner]:
    """`learner` itself with one rank; else start the followers and yield rank 0's
    `LeadLearner`; on exit the followers stop."""
    if config.dist.learner_ranks == 1:
        yield learner
        return
    with learner_ranks(config, Follower(follow, "qarl.train.learner.follow")) as group:
        yield lead(config, group, learner)


def follow(rank: int, world: int, init, config: RunConfig) -> int:
    """A follower rank's whole life: join (`qarl.parallel.ranks.join_group`'s `init`), build
    the learner, take rank 0's state, follow rank 0's messages until it says stop. Returns the
    exit code: 0, or 1 when rank 0 went away first."""
    if isinstance(init, str):
        Path(f"{init}.ready{rank}").touch()  # rank 0 waits for these before it joins
    join_group(rank, world, init)
    group = RankGroup(rank, world, lockstep=config.dist.learner_strategy == "fsdp")
    dtype = DTYPES[config.model.master_dtype]
    precision = Precision.of(config.train, config.quant)
    try:
        if group.lockstep:  # FSDP: the structure only; the shards are filled from rank 0
            model, _ = learner_model(load_skeleton(config.model.name, dtype=dtype), config,
                                     precision, adapters=False)
            learner: Learner = _fsdp_learner(config, group, model, None)
        else:
            # LoRA: rank 0's adapters arrive with its state
            model, _ = learner_model(load_model(config.model.name, dtype=dtype), config,
                                     precision)
            optimizers = _optimizers(config)(model)
            share_state(group, model, optimizers)
            replayer = make_replayer(config, model, load_tokenizer(config.model.name), precision)
            passes = Passes(model, replayer, precision, config.train,
                            config.quant.routing_replay, solo=False)
            learner = AlignedLearner(passes, optimizers, group)
        while (message := group.broadcast(None)) is not None:
            kind, *args = message
            if kind == "update":
                exp, step = args
                learner.update(exp, config.algo, config.train, step)
            elif kind == "optimizer_state":
                with learner.whole_optimizer_state():
                    pass
    except LearnerRankDied:
        return 1  # rank 0 stopped (it says why, and saves what it can)
    finally:
        leave_group()
    return 0


if __name__ == "__main__":
    follower_main(follow)
