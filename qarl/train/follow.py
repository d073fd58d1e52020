"""The learner on several ranks (`dist.learner_ranks = M > 1`): rank 0's learner, the FSDP
learner, and the body every follower rank runs (`python -m qarl.train.follow`, or a Ray actor).

The trainer is rank 0. `learner_on_ranks` starts ranks 1..M-1 (`qarl.parallel.launch`, handed
`follow` as their body), shares rank 0's weights and optimizer state with them (once, after
any warm start or resume), and gives the trainer a `LeadLearner`: the same `Learner` as in
one process, whose `update` first sends the step's `Experience` to every rank. Each follower
builds the learner as the trainer does (`load_model` + `quantize_learner`; a meta-device
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
from qarl.rollout import LocalEngine
from qarl.train.learner import AlignedLearner, Learner, later_logp
from qarl.train.logprobs import ForwardScorer, response_logprobs
from qarl.train.optim import build_optimizer
from qarl.train.phases import Experience
from qarl.train.setup import adapt_learner, make_replayer, quantize_learner
from qarl.train.update import update_policy
from qarl.types import RolloutBatch, SamplingParams


class FsdpLearner:
    """One rank's FSDP learner: trains its shards (`sharded`); on rank 0 also the whole
    learner `whole` (what `model` is there), its `replayer` and its (state-free) optimizers,
    which hold the whole state only inside `whole_optimizer_state`."""

    def __init__(self, sharded: ShardedLearner, group: RankGroup, whole: CausalLM | None = None,
                 optimizers: list | None = None,
                 replayer: LocalEngine | ForwardScorer | None = None,
                 routing_replay: bool = False):
        self.sharded, self.group, self.whole, self.replayer = sharded, group, whole, replayer
        self.model = whole if whole is not None else sharded.model
        self.optimizers = optimizers or []
        self.routing_replay = routing_replay

    def replay(self, batch: RolloutBatch, sampling: SamplingParams, for_update: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        # every row scored: the gradient forward runs on shards, split among the ranks
        return self.replayer.score_routing(batch, sampling, replay=self.routing_replay)

    def logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[Tensor, Tensor]:
        return response_logprobs(self.sharded.model, batch, temperature,
                                 routing_replay=self.routing_replay)

    def update(self, exp: Experience, algo: AlgoSection, train: TrainSection,
               step: int) -> dict[str, float]:
        metrics = update_policy(self.sharded.model, self.sharded.optimizers, self.group,
                                self._exact, exp, algo, train, step, self.routing_replay)
        self.sharded.publish(self.whole)  # rank 0 receives the stepped shards, the others send
        return metrics

    def release_caches(self) -> None:
        if self.replayer is not None:
            self.replayer.release_caches()

    def _exact(self, exp: Experience, rows: range) -> Tensor:
        """A later optimizer step's logp value (`learner.later_logp`): rank 0 on its whole
        learner (the shards gathered first), broadcast to every rank."""
        self.sharded.publish(self.whole)
        logp = None if self.whole is None else later_logp(self, exp, rows)
        return self.group.broadcast(logp)

    @contextlib.contextmanager
    def whole_optimizer_state(self) -> Iterator[None]:
        """Collective: the shards' optimizer state gathered into rank 0's optimizers, freed after."""
        self.sharded.full_optimizer_state(self.whole, self.optimizers if self.whole else None)
        try:
            yield
        finally:
            clear_state(self.optimizers)


class LeadLearner:
    """Rank 0's learner with followers: `inner`'s, each update and checkpoint gather first
    announced to the other ranks."""

    def __init__(self, inner: Learner, group: RankGroup):
        self.inner, self.group = inner, group
        self.model, self.optimizers = inner.model, inner.optimizers

    def replay(self, batch: RolloutBatch, sampling: SamplingParams, for_update: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        return self.inner.replay(batch, sampling, for_update)

    def logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[Tensor, Tensor]:
        return self.inner.logprobs(batch, temperature)

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
    if whole is None:
        return FsdpLearner(sharded, group, routing_replay=config.quant.routing_replay)
    clear_state(whole.optimizers)  # the shards hold it
    return FsdpLearner(sharded, group, whole.model, whole.optimizers, whole.replayer,
                       whole.routing_replay)


def lead(config: RunConfig, group: RankGroup, learner: AlignedLearner) -> LeadLearner:
    """Rank 0's learner over joined ranks: `learner`'s state shared with every follower."""
    if config.dist.learner_strategy == "fsdp":
        return LeadLearner(_fsdp_learner(config, group, copy.deepcopy(learner.model), learner), group)
    share_state(group, learner.model, learner.optimizers)
    return LeadLearner(AlignedLearner(learner.model, learner.optimizers, learner.replayer,
                                      learner.routing_replay, group), group)


@contextlib.contextmanager
def learner_on_ranks(config: RunConfig, learner: AlignedLearner) -> Iterator[Learner]:
    """`learner` itself with one rank; else start the followers and yield rank 0's
    `LeadLearner`; on exit the followers stop."""
    if config.dist.learner_ranks == 1:
        yield learner
        return
    with learner_ranks(config, Follower(follow, "qarl.train.follow")) as group:
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
    try:
        if group.lockstep:  # FSDP: the structure only; the shards are filled from rank 0
            model = quantize_learner(load_skeleton(config.model.name, dtype=dtype),
                                     config.quant, config.train)
            learner: Learner = _fsdp_learner(config, group, model, None)
        else:
            model = quantize_learner(load_model(config.model.name, dtype=dtype),
                                     config.quant, config.train)
            adapt_learner(model, config)  # LoRA: rank 0's adapters arrive with its state
            optimizers = _optimizers(config)(model)
            share_state(group, model, optimizers)
            replayer = make_replayer(config, model, load_tokenizer(config.model.name),
                                     config.model.max_context)
            learner = AlignedLearner(model, optimizers, replayer, config.quant.routing_replay,
                                     group)
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
