"""Learner ranks: a data-parallel learner over `torch.distributed` (gloo), launched by qarl.

With `dist.learner_ranks = M > 1` the trainer process is rank 0 and M - 1 followers run
`follower`: with `dist.learner_placement = "local"`, processes on this machine
(`python -m qarl.train.ranks`, given the resolved recipe: a fresh interpreter never re-runs
the caller's script, as multiprocessing's spawn would) joined through a file; with "ray",
Ray actors the cluster places (`qarl.dist.RayRanks`, possibly on other machines) joined
through a TCP store that rank 0 opens. Each follower builds the learner as the trainer does
(`load_model` + `quantize_learner`), takes rank 0's weights and optimizer state (broadcast
once, after any warm start or resume), and then, every step:

1. receives the step's `Experience` from rank 0 (samples, old_logp, advantages: rank 0 alone
   generates, scores rewards, syncs the engine and writes checkpoints);
2. runs `phases.update_policy` on it like rank 0, on its share of the micro-batches
   (micro-batch j goes to rank j mod M); the loss is normalized by the WHOLE batch's token /
   sequence counts (`global_counts`), so the gradients of all micro-batches add up to the
   one-rank gradient;
3. sums the gradients over ranks (`all_reduce`, one flat buffer) before clipping and the
   optimizer step, which then run identically on every rank: the ranks' weights stay equal.

Only the order of the floating-point sums differs from one rank; the measured effect is in
docs/distributed.md. A rank that dies breaks rank 0's next collective: the run ends with
`LearnerRankDied` (the trainer adds the last checkpoint, which a failed step never touches).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from qarl.config import RunConfig, load_config, save_resolved
from qarl.model import CausalLM, load_model, load_tokenizer
from qarl.rollout import LocalEngine
from qarl.train.optim import build_optimizer

# Followers wait in a broadcast while rank 0 generates, scores and evaluates, which can take
# hours on a CPU; a dead rank is noticed by its closed connection, not by this timeout.
_TIMEOUT = timedelta(hours=24)
# Before joining, a follower imports torch and qarl: seconds, minutes on a loaded machine.
# A follower that dies before it joins is seen by rank 0 at once (its exit code); this limit
# only ends a wait on followers that neither join nor die.
_JOIN_TIMEOUT_S = 600.0


class LearnerRankDied(RuntimeError):
    """A learner rank stopped answering (its process died): the run cannot go on."""


@dataclass
class RankGroup:
    """This process's place among the learner ranks, and the collectives of one update."""

    rank: int
    world: int
    members: tuple = ()  # rank 0: the followers (LocalRank / qarl.dist.RayRank), to name a dead one

    def micro_batches(self, starts: range) -> range:
        """The micro-batch start rows this rank computes: every world-th, from its rank."""
        return starts[self.rank :: self.world]

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """Replace every parameter's gradient by its sum over the ranks (fp32 flat buffer);
        a parameter without a gradient on every rank keeps none."""
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


def share_state(group: RankGroup, learner: CausalLM, optimizers: list) -> None:
    """Rank 0's weights (every state-dict entry) and optimizer state on every rank."""
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
                                world_size=world, timeout=_TIMEOUT)
        return
    host, port = init
    store = dist.TCPStore(host, port, world, is_master=False, timeout=_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=_TIMEOUT)


def follower(rank: int, world: int, init, config: RunConfig) -> int:
    """A follower rank's whole life: join (`join_group`'s `init`), build the learner, update
    until rank 0 says stop. Returns the exit code: 0, or 1 when rank 0 went away first."""
    from qarl.train.phases import update_policy
    from qarl.train.setup import DTYPES, quantize_learner

    if isinstance(init, str):
        Path(f"{init}.ready{rank}").touch()  # rank 0 waits for these before it joins
    join_group(rank, world, init)
    learner = quantize_learner(load_model(config.model.name, dtype=DTYPES[config.model.master_dtype]),
                               config.quant)
    scorer = LocalEngine.from_tokenizer(learner, load_tokenizer(config.model.name),
                                        max_context=config.model.max_context)
    train = config.train
    optimizers = build_optimizer(learner, train.optimizer, train.lr, train.weight_decay,
                                 tuple(train.betas))
    group = RankGroup(rank, world)
    try:
        share_state(group, learner, optimizers)
        replica = Replica(learner, scorer, group, config.quant.routing_replay)
        while (message := group.broadcast(None)) is not None:
            exp, step = message
            update_policy(replica, optimizers, exp, config.algo, train, step)
    except LearnerRankDied:
        return 1  # rank 0 stopped (it says why, and saves what it can)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


class LocalRank:
    """A follower process on this machine (`dist.learner_placement = "local"`)."""

    def __init__(self, process: subprocess.Popen, init_file: str, rank: int):
        self.process, self.init_file, self.rank = process, init_file, rank

    def ready(self) -> bool:
        """True once it is about to join (its `init_file.ready<rank>` exists)."""
        return Path(f"{self.init_file}.ready{self.rank}").exists()

    def exit_reason(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"exit code {code}"

    def stop(self, timeout_s: float = 30) -> None:
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()


def wait_for_followers(members: list, timeout_s: float = _JOIN_TIMEOUT_S) -> None:
    """Return once every follower is about to join (`member.ready()`); raise LearnerRankDied
    at once if one ends first (`member.exit_reason()`), or after `timeout_s` if one does
    neither. Without this, rank 0 would wait in the rendezvous for the 24-hour timeout."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(enumerate(members, start=1))
    while waiting:
        for rank, member in list(waiting.items()):
            if member.ready():
                del waiting[rank]
            elif (reason := member.exit_reason()) is not None:
                raise LearnerRankDied(
                    f"learner rank {rank} of {len(members) + 1} ended ({reason}) before "
                    "joining the others; its error is above (Ray-placed ranks: in the Ray logs)")
        if waiting and time.monotonic() > deadline:
            raise LearnerRankDied(
                f"learner ranks {sorted(waiting)} did not start within {timeout_s:.0f} s; a "
                "machine this loaded may need fewer dist.learner_ranks (a Ray cluster: free "
                "CPUs for dist.cpus_per_rank each, `ray status`)")
        time.sleep(0.05)


def exit_with_parent(parent: int, interval_s: float = 1.0) -> None:
    """End this process soon after its parent `parent` (the pid that started it, passed by
    the parent itself: a parent gone before this call is seen too) is gone. A SIGKILLed rank
    0 leaves its followers waiting in a collective for the 24-hour timeout otherwise."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="qarl-parent-watch", daemon=True).start()


@contextmanager
def learner_ranks(config: RunConfig, learner: CausalLM, optimizers: list) -> Iterator[RankGroup | None]:
    """None with one rank; else start the followers (`dist.learner_placement`), share rank
    0's state with them, yield rank 0's group, and on exit tell the followers to stop and
    wait for them."""
    world = config.dist.learner_ranks
    if world == 1:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="qarl-ranks-") as tmp:
        followers = (ray_followers(config) if config.dist.learner_placement == "ray"
                     else local_followers(config, tmp))
        with followers as (members, join):
            group = RankGroup(0, world, tuple(members))
            try:
                wait_for_followers(members)
                join()
                share_state(group, learner, optimizers)
                yield group
                group.broadcast(None)  # the followers' loop ends
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()


@contextmanager
def local_followers(config: RunConfig, tmp: str):
    """Ranks 1..M-1 as processes on this machine, joined through a file in `tmp`: yields
    (their LocalRanks, rank 0's join)."""
    world = config.dist.learner_ranks
    init_file = str(Path(tmp) / "init")
    recipe = save_resolved(config, tmp)
    members = [LocalRank(subprocess.Popen([sys.executable, "-m", "qarl.train.ranks", str(r),
                                           str(world), init_file, str(recipe), str(os.getpid())]),
                         init_file, r)
               for r in range(1, world)]
    try:
        yield members, lambda: join_group(0, world, init_file)
    finally:
        for member in members:
            member.stop()


@contextmanager
def ray_followers(config: RunConfig):
    """Ranks 1..M-1 as Ray actors (`qarl.dist.RayRanks`) on the cluster `dist.address` names,
    joined through a TCP store this process opens on its own address: yields (their
    RayRanks, rank 0's join)."""
    from functools import partial

    from qarl.dist import RayRanks, connect, node_address  # Ray only when the recipe asks

    world = config.dist.learner_ranks
    connect(config.dist.address)
    ranks = RayRanks(partial(follower, config=config), world, config.dist.cpus_per_rank)
    try:
        # the store listens on every interface; the followers reach it at this node's address
        store = dist.TCPStore("0.0.0.0", 0, world, is_master=True, timeout=_TIMEOUT,
                              wait_for_workers=False)

        def join() -> None:
            ranks.start((node_address(), store.port))
            dist.init_process_group("gloo", store=store, rank=0, world_size=world,
                                    timeout=_TIMEOUT)

        yield ranks.members, join
    finally:
        ranks.close()


def _run_local_follower(rank: int, world: int, init_file: str, recipe: str, parent: int) -> int:
    """The body of `python -m qarl.train.ranks`: a local follower of rank 0 (pid `parent`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: rank 0 stops the run, then us
    exit_with_parent(parent)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return follower(rank, world, init_file, load_config(recipe))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A follower learner rank (started by qarl train).")
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("init_file")
    parser.add_argument("recipe")
    parser.add_argument("parent", type=int, help="rank 0's pid: the follower ends with it")
    args = parser.parse_args()
    sys.exit(_run_local_follower(args.rank, args.world, args.init_file, args.recipe, args.parent))
