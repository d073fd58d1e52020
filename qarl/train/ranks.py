"""Learner ranks: a data-parallel learner over `torch.distributed` (gloo).

With `dist.learner_ranks = M > 1` the trainer process is rank 0 and M - 1 followers run
`follower` (started by `qarl.train.launch`, on this machine or placed by Ray). Each follower
builds the learner as the trainer does (`load_model` + `quantize_learner`), takes rank 0's
weights and optimizer state (once, after any warm start or resume), and then, every step:

1. receives the step's `Experience` from rank 0 (samples, old_logp, advantages: rank 0 alone
   generates, scores rewards, syncs the engine and writes checkpoints);
2. runs `phases.update_policy` on it like rank 0, on its share of the micro-batches
   (micro-batch j goes to rank j mod M); the loss is normalized by the WHOLE batch's token /
   sequence counts (`global_counts`), so the gradients of all micro-batches add up to the
   one-rank gradient;
3. sums the gradients over ranks before clipping and the optimizer step: with
   `dist.learner_strategy = "replicate"` an `all_reduce` of one flat buffer, after which every
   rank steps its whole copy identically; with "fsdp" (`qarl.train.sharded`) the backward
   reduce-scatters them and each rank steps its shard, and rank 0's whole learner is
   refreshed from the shards after the update.

Rank 0 drives the followers with messages (`RankGroup.broadcast`): ("update", experience,
step), ("optimizer_state",) before a checkpoint (FSDP: the shards' state gathered to rank 0),
None to stop. Only the order of the floating-point sums differs from one rank; the measured
effect is in docs/distributed.md. A rank that dies breaks rank 0's next collective: the run
ends with `LearnerRankDied` (the trainer adds the last checkpoint, which a failed step never
touches).
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from qarl.config import AlgoSection, RunConfig, TrainSection
from qarl.model import CausalLM, load_model, load_skeleton, load_tokenizer
from qarl.rollout import LocalEngine
from qarl.train.optim import build_optimizer
from qarl.train.sharded import ShardedLearner, ShardedReplica, clear_state

# Followers wait in a broadcast while rank 0 generates, scores and evaluates, which can take
# hours on a CPU; a dead rank is noticed by its closed connection, not by this timeout.
COLLECTIVE_TIMEOUT = timedelta(hours=24)


class LearnerRankDied(RuntimeError):
    """A learner rank stopped answering (its process died): the run cannot go on."""


@dataclass
class RankGroup:
    """This process's place among the learner ranks, and the collectives of one update."""

    rank: int
    world: int
    members: tuple = ()  # rank 0: the followers (launch.LocalRank / qarl.dist.RayRank), to name a dead one
    sharded: ShardedLearner | None = None  # learner_strategy = "fsdp": this rank's shards
    replica: ShardedReplica | None = None  # ... and what update_policy reads of them

    @property
    def lockstep(self) -> bool:
        """Every rank must run every micro-batch's backward (FSDP: backward is a collective)."""
        return self.sharded is not None

    def micro_batches(self, starts: range) -> range:
        """The micro-batch start rows this rank computes: every world-th, from its rank."""
        return starts[self.rank :: self.world]

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """Replace every parameter's gradient by its sum over the ranks (fp32 flat buffer);
        a parameter without a gradient on every rank keeps none. FSDP ranks: nothing to do,
        their backward reduce-scattered the sums."""
        if self.sharded is not None:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params])  # [total parameters] float32
        self._all_reduce(has_grad, dist.ReduceOp.MAX)
        self._all_reduce(flat, dist.ReduceOp.SUM)
        offset = 0
        for p, present in zip(params, has_grad.tolist()):
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype) if present else None
            offset += n

    def sum_floats(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        self._all_reduce(t, dist.ReduceOp.SUM)
        return t.tolist()

    def sum_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """Per-key sums of every rank's metric dict (ranks may miss keys: a rank that stopped
        at a non-finite loss saw fewer micro-batches)."""
        gathered: list = [None] * self.world
        self._call(dist.all_gather_object, gathered, totals)
        keys = sorted({k for d in gathered for k in d})
        return {k: sum(d.get(k, 0.0) for d in gathered) for k in keys}

    def all_true(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int32)
        self._all_reduce(t, dist.ReduceOp.MIN)
        return bool(t.item())

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (pickled: the ranks are this run's own processes)."""
        box = [obj]
        self._call(dist.broadcast_object_list, box, src=0)
        return box[0]

    def _all_reduce(self, tensor: torch.Tensor, op) -> None:
        self._call(dist.all_reduce, tensor, op=op)

    def _call(self, collective, *args, **kwargs) -> None:
        try:
            collective(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as error:
            raise LearnerRankDied(self._who_died(error)) from error

    def _who_died(self, error: BaseException, settle_s: float = 10.0) -> str:
        """Name the dead follower(s). The collective can fail a moment before the death is
        visible (the process not yet reaped, Ray not yet told): look again for `settle_s`."""
        deadline = time.monotonic() + settle_s
        while True:
            dead = [(r, reason) for r, m in enumerate(self.members, start=1)
                    if (reason := m.exit_reason()) is not None]
            if dead or not self.members or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if dead:
            ranks = ", ".join(f"rank {r} ({reason})" for r, reason in dead)
            return (f"learner {ranks} of {self.world} died; its error, if any, is above (a "
                    "Ray-placed rank's: in the Ray logs, /tmp/ray/session_latest/logs)")
        return (f"rank {self.rank}'s collective failed ({str(error).splitlines()[0]}); another "
                f"learner rank of {self.world} is gone")


class Replica:
    """A follower's learner with what `update_policy` reads of a `Policy`."""

    def __init__(self, learner: CausalLM, scorer: LocalEngine, ranks: RankGroup,
                 routing_replay: bool = False):
        self.learner, self.scorer, self.ranks = learner, scorer, ranks
        self.routing_replay = routing_replay  # MoE: the engine's experts, as on rank 0

    def replay(self, batch, sampling):
        return self.scorer.score_routing(batch, sampling, replay=self.routing_replay)[0]


def share_state(group: RankGroup, learner: CausalLM, optimizers: list, config: RunConfig,
                scorer: LocalEngine | None = None) -> None:
    """Rank 0's weights (every state-dict entry) and optimizer state on every rank. FSDP:
    each rank shards its learner (rank 0 a copy: it keeps its whole one, and frees its whole
    optimizer state) and takes its shards of rank 0's state; `scorer` is rank 0's."""
    if config.dist.learner_strategy == "fsdp":
        whole = learner if group.rank == 0 else None
        group.sharded = ShardedLearner(copy.deepcopy(learner) if whole else learner, config.train)
        stepped = group.broadcast(any(opt.state for opt in optimizers) if whole else None)
        group.sharded.load(whole, optimizers if whole else None, stepped)
        if whole is not None:
            clear_state(optimizers)
        group.replica = ShardedReplica(group.sharded, group, config.quant.routing_replay,
                                       whole, scorer)
        return
    state = {name: t.detach().clone() for name, t in learner.state_dict().items()}
    for t in state.values():
        group._call(dist.broadcast, t, src=0)
    opt_states = group.broadcast([opt.state_dict() for opt in optimizers])
    if group.rank != 0:
        learner.load_state_dict(state)
        for opt, opt_state in zip(optimizers, opt_states):
            opt.load_state_dict(opt_state)


def join_group(rank: int, world: int, init) -> None:
    """Join the learner ranks' process group (gloo). `init`: the rendezvous file's path (local
    ranks), or (host, port) of the TCP store rank 0 opened (Ray-placed ranks)."""
    if isinstance(init, str):
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world, timeout=COLLECTIVE_TIMEOUT)
        return
    host, port = init
    store = dist.TCPStore(host, port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)


def follower(rank: int, world: int, init, config: RunConfig) -> int:
    """A follower rank's whole life: join (`join_group`'s `init`), build the learner, follow
    rank 0's messages until it says stop. Returns the exit code: 0, or 1 when rank 0 went away
    first."""
    from qarl.train.phases import update_policy
    from qarl.train.setup import DTYPES, quantize_learner

    if isinstance(init, str):
        Path(f"{init}.ready{rank}").touch()  # rank 0 waits for these before it joins
    join_group(rank, world, init)
    # FSDP: the structure only (shards allocated once sharded, filled from rank 0), and the
    # shards' own optimizers (built by ShardedLearner)
    sharded = config.dist.learner_strategy == "fsdp"
    load = load_skeleton if sharded else load_model
    learner = quantize_learner(load(config.model.name, dtype=DTYPES[config.model.master_dtype]),
                               config.quant)
    train = config.train
    optimizers = [] if sharded else build_optimizer(learner, train.optimizer, train.lr,
                                                    train.weight_decay, tuple(train.betas))
    group = RankGroup(rank, world)
    try:
        share_state(group, learner, optimizers, config)
        if group.sharded is not None:
            replica, optimizers = group.replica, group.sharded.optimizers
        else:
            scorer = LocalEngine.from_tokenizer(learner, load_tokenizer(config.model.name),
                                                max_context=config.model.max_context)
            replica = Replica(learner, scorer, group, config.quant.routing_replay)
        while (message := group.broadcast(None)) is not None:
            kind, *args = message
            if kind == "update":
                exp, step = args
                update_policy(replica, optimizers, exp, config.algo, train, step)
                if group.sharded is not None:
                    group.sharded.publish(None)
            elif kind == "optimizer_state":
                group.sharded.full_optimizer_state(None, None)
    except LearnerRankDied:
        return 1  # rank 0 stopped (it says why, and saves what it can)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def update_on_ranks(group: RankGroup, policy, optimizers: list, exp, algo: AlgoSection,
                    train: TrainSection, step: int) -> dict[str, float]:
    """Rank 0's update with learner ranks: the experience to every rank, this rank's share of
    the micro-batches, and with FSDP rank 0's whole learner refreshed from the shards."""
    from qarl.train.phases import update_policy

    group.broadcast(("update", exp, step))
    if group.sharded is None:
        return update_policy(policy, optimizers, exp, algo, train, step)
    metrics = update_policy(group.replica, group.sharded.optimizers, exp, algo, train, step)
    group.sharded.publish(policy.learner)
    return metrics


@contextmanager
def whole_optimizer_state(group: RankGroup | None, learner: CausalLM, optimizers: list):
    """Rank 0's `optimizers` hold the whole optimizer state inside the block (a checkpoint
    being written): with FSDP ranks gathered from the shards, and freed after."""
    if group is None or group.sharded is None:
        yield
        return
    group.broadcast(("optimizer_state",))
    group.sharded.full_optimizer_state(learner, optimizers)
    try:
        yield
    finally:
        clear_state(optimizers)
