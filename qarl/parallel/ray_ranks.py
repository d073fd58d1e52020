"""`RayRanks`: learner ranks 1..M-1 as Ray actors, so a data-parallel learner spans machines.

The trainer (rank 0, `qarl.parallel.launch.learner_ranks` with `dist.learner_placement =
"ray"`) passes the follower's body (`qarl.train.learner.follow.follow`); this module only places and
watches the actors:

- each actor reserves `cpus_per_rank` CPUs (Ray sets its torch threads to that) and is
  scheduled with Ray's SPREAD strategy, so on a cluster the ranks go to different machines
  where there is room;
- `start((host, port))` runs the body in every actor with that rendezvous (rank 0's TCP
  store); the call returns the follower's exit code when rank 0 ends the run;
- actors are never restarted (`max_restarts = 0`): a rank cannot rejoin a running process
  group, so a dead rank ends the run (rank 0's next collective fails and names it through
  `exit_reason`). Ray ends the actors with the driver that owns them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import ray
from ray.exceptions import RayError, RayTaskError


class RankWorker:
    """The body of one learner-rank actor."""

    def __init__(self, body: Callable[[int, int, object], int]):
        self.body = body

    def pid(self) -> int:
        return os.getpid()

    def run(self, rank: int, world: int, init) -> int:
        return self.body(rank, world, init)


class RayRank:
    """One follower actor as rank 0 watches it: `ready()` once its actor is up,
    `exit_reason()` once it has ended (None while it runs)."""

    def __init__(self, actor):
        self.actor = actor
        self._up = actor.pid.remote()  # resolves when the actor's constructor has run
        self.running = None

    def start(self, rank: int, world: int, init) -> None:
        self.running = self.actor.run.remote(rank, world, init)

    def ready(self) -> bool:
        return _finished(self._up) and _failure(self._up) is None

    def exit_reason(self) -> str | None:
        if _finished(self._up) and (failure := _failure(self._up)) is not None:
            return failure
        if self.running is None or not _finished(self.running):
            return None
        return _failure(self.running) or f"its Ray actor returned {ray.get(self.running)}"


class RayRanks:
    """Learner ranks 1..world-1 in Ray actors, each running `body(rank, world, init)` once
    started. Needs a connected Ray (`qarl.parallel.connect`)."""

    def __init__(self, body: Callable[[int, int, object], int], world: int, cpus_per_rank: int = 1):
        actor = ray.remote(RankWorker).options(num_cpus=cpus_per_rank, max_restarts=0,
                                               scheduling_strategy="SPREAD")
        self.world = world
        self.members = [RayRank(actor.remote(body)) for _ in range(1, world)]

    def start(self, init) -> None:
        for rank, member in enumerate(self.members, start=1):
            member.start(rank, self.world, init)

    def close(self, timeout_s: float = 30) -> None:
        """Wait up to `timeout_s` for the started ranks to return, then end every actor."""
        runs = [m.running for m in self.members if m.running is not None]
        if runs:
            ray.wait(runs, num_returns=len(runs), timeout=timeout_s)
        for member in self.members:
            ray.kill(member.actor, no_restart=True)
        self.members = []


def node_address() -> str:
    """This process's address on the Ray cluster (where the other machines reach it)."""
    return ray.util.get_node_ip_address()


def _finished(ref) -> bool:
    return bool(ray.wait([ref], timeout=0)[0])


def _failure(ref) -> str | None:
    """How the finished call `ref` failed (its actor died, its body raised), or None."""
    try:
        ray.get(ref)
    except RayTaskError as error:  # the body raised: its own exception, not Ray's header
        cause = error.cause
        return f"it raised {type(cause).__name__}: {str(cause).strip().splitlines()[0]}"
    except RayError as error:  # the actor died (killed, out of memory, its machine gone)
        return f"its Ray actor failed: {str(error).strip().splitlines()[0]}"
    return None
