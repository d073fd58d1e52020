"""Starting learner ranks 1..M-1 (`dist.learner_placement`), and ending them.

What a follower runs is handed in (`Follower`): its body, `body(rank, world, init, config)`,
and the module that runs it as a process on this machine (`python -m MODULE`, whose
`__main__` calls `follower_main`); the trainer's is `qarl.train.learner.follow`.

- "local": processes on this machine (`python -m MODULE`, given the resolved recipe: a fresh
  interpreter never re-runs the caller's script, as multiprocessing's spawn would), joined
  through a rendezvous file in a temporary folder; each ends itself within a second of rank
  0's process going away (`exit_with_parent`).
- "ray": Ray actors the cluster places (`qarl.parallel.RayRanks`, possibly on other
  machines), joined through a TCP store rank 0 opens on its node address; Ray ends them with
  rank 0.

Either way rank 0 first waits until every follower is about to join (`wait_for_followers`):
one that ends before, or neither joins nor ends within 10 minutes, ends the run at once with
its rank and how it ended, instead of rank 0 waiting out the 24-hour rendezvous timeout.
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
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from qarl.config import RunConfig, load_config, save_resolved
from qarl.native.memory import tune_allocator
from qarl.parallel.ranks import COLLECTIVE_TIMEOUT, LearnerRankDied, RankGroup, join_group, leave_group

# Before joining, a follower imports torch and qarl: seconds, minutes on a loaded machine.
# A follower that dies before it joins is seen by rank 0 at once (its exit code); this limit
# only ends a wait on followers that neither join nor die.
_JOIN_TIMEOUT_S = 600.0


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


@dataclass(frozen=True)
class Follower:
    """What ranks 1..M-1 run: `body(rank, world, init, config) -> exit code` (in a Ray actor
    as it is; on this machine in `python -m module`, whose `__main__` calls `follower_main`)."""

    body: Callable[[int, int, object, RunConfig], int]
    module: str


@contextmanager
def learner_ranks(config: RunConfig, follower: Follower) -> Iterator[RankGroup]:
    """Start ranks 1..M-1 (`dist.learner_placement`), join them, yield rank 0's group; on
    exit tell the followers to stop (a None message) and wait for them."""
    world = config.dist.learner_ranks
    with tempfile.TemporaryDirectory(prefix="qarl-ranks-") as tmp:
        followers = (ray_followers(config, follower) if config.dist.learner_placement == "ray"
                     else local_followers(config, follower, tmp))
        with followers as (members, join):
            group = RankGroup(0, world, tuple(members),
                              lockstep=config.dist.learner_strategy == "fsdp")
            try:
                wait_for_followers(members)
                join()
                yield group
                group.broadcast(None)  # the followers' loop ends
            finally:
                leave_group()


@contextmanager
def local_followers(config: RunConfig, follower: Follower, tmp: str):
    """Ranks 1..M-1 as processes on this machine, joined through a file in `tmp`: yields
    (their LocalRanks, rank 0's join)."""
    world = config.dist.learner_ranks
    init_file = str(Path(tmp) / "init")
    recipe = save_resolved(config, tmp)
    members = [LocalRank(subprocess.Popen([sys.executable, "-m", follower.module, str(r),
                                           str(world), init_file, str(recipe), str(os.getpid())]),
                         init_file, r)
               for r in range(1, world)]
    try:
        yield members, lambda: join_group(0, world, init_file)
    finally:
        for member in members:
            member.stop()


@contextmanager
def ray_followers(config: RunConfig, follower: Follower):
    """Ranks 1..M-1 as Ray actors (`qarl.parallel.RayRanks`) on the cluster `dist.address`
    names, joined through a TCP store this process opens on its own address: yields (their
    RayRanks, rank 0's join)."""
    from functools import partial

    from qarl.parallel import RayRanks, connect, node_address  # Ray only when the recipe asks

    world = config.dist.learner_ranks
    connect(config.dist.address)
    ranks = RayRanks(partial(follower.body, config=config), world, config.dist.cpus_per_rank)
    try:
        # the store listens on every interface; the followers reach it at this node's address
        store = dist.TCPStore("0.0.0.0", 0, world, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                              wait_for_workers=False)

        def join() -> None:
            ranks.start((node_address(), store.port))
            dist.init_process_group("gloo", store=store, rank=0, world_size=world,
                                    timeout=COLLECTIVE_TIMEOUT)

        yield ranks.members, join
    finally:
        ranks.close()


def follower_main(body: Callable[[int, int, object, RunConfig], int]) -> None:
    """The `__main__` of a local follower's module: `python -m MODULE RANK WORLD INIT_FILE
    RECIPE PARENT` runs `body` as rank RANK of rank 0 (pid PARENT) and exits with its code."""
    parser = argparse.ArgumentParser(description="A follower learner rank (started by qarl train).")
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("init_file")
    parser.add_argument("recipe")
    parser.add_argument("parent", type=int, help="rank 0's pid: the follower ends with it")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: rank 0 stops the run, then us
    exit_with_parent(args.parent)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    tune_allocator()  # as rank 0 does in qarl.train
    sys.exit(body(args.rank, args.world, args.init_file, load_config(args.recipe)))
