"""The reward runner: score completions in worker processes, each call under a deadline.

`RewardRunner(spec, num_workers, timeout_s)` keeps a pool of worker processes alive between
steps. Each worker imports the reward once (at start, before any deadline runs), then serves
one call at a time over its own pipe. Every call ends in exactly one outcome:

  ok          the reward returned a finite number
  unscorable  the reward returned None
  error       the reward raised, returned something that is not a finite number, or its
              worker died; the message is kept in `RewardResult.errors`
  timeout     no answer within timeout_s of the call reaching the worker; the worker is
              killed and replaced, the other calls go on

Rewards of error/timeout calls are None (never a silent 0); the counts come back with them.
Workers start with "forkserver" (Linux default here) or "spawn": never "fork", which is unsafe
once the parent has loaded torch and its thread pools. `num_workers=0` scores inline in the
calling process (no process start-up; exceptions are still counted, but deadlines cannot be
enforced): for tests and debugging.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import sys
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from qarl.tasks.rewards import load_reward, resolve_spec

OUTCOMES = ("ok", "unscorable", "error", "timeout")
START_METHODS = ("forkserver", "spawn")

Call = tuple[str, str, dict[str, Any]]  # (prompt, completion, reward fields)


@dataclass
class RewardResult:
    """Rewards of one batch of calls, in call order, with the outcome of each."""

    rewards: list[float | None]
    outcomes: list[str]  # one of OUTCOMES per call
    errors: dict[int, str] = field(default_factory=dict)  # call index -> message (error/timeout)
    seconds: float = 0.0  # wall time of the batch

    @property
    def counts(self) -> dict[str, int]:
        """Number of calls per outcome (every outcome present, zeros included)."""
        return {o: self.outcomes.count(o) for o in OUTCOMES}


def _describe(exc: BaseException) -> str:
    """'Type: message (at file:line in function)' of an exception raised by a reward."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {last.filename}:{last.lineno} in {last.name})"
    return text


def score_one(fn: Any, prompt: str, completion: str, fields: dict[str, Any]) -> tuple[str, Any]:
    """(outcome, reward or error message) of one reward call, exceptions included."""
    try:
        value = fn(prompt, completion, **fields)
    except Exception as e:  # a user reward may raise anything; it becomes a counted outcome
        return "error", _describe(e)
    if value is None:
        return "unscorable", None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return "error", (
            f"reward returned {value!r} ({type(value).__name__}); a reward returns a finite "
            "float, or None when the completion cannot be scored"
        )
    return "ok", float(value)


def _worker_main(spec: str, conn: Connection, parent_sys_path: list[str]) -> None:
    """Worker loop: load the reward, report ready, then answer (index, call) until None."""
    # A forkserver child inherits the server's sys.path, frozen when the server started;
    # the parent's current one is what a user's "module:function" was written against.
    sys.path[:] = parent_sys_path
    try:
        fn = load_reward(spec)
    except Exception as e:
        conn.send(("init_error", _describe(e)))
        return
    conn.send(("ready", None))
    while True:
        job = conn.recv()
        if job is None:
            return
        index, (prompt, completion, fields) = job
        conn.send((index, score_one(fn, prompt, completion, fields)))


class _Worker:
    """One worker process, its pipe, and the call it is running (if any)."""

    def __init__(self, ctx: Any, spec: str) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(spec, child, list(sys.path)), daemon=True
        )
        self.process.start()
        child.close()
        self.ready = False
        self.index: int | None = None  # call in flight
        self.deadline = math.inf

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class RewardRunner:
    """A persistent pool of reward workers; see the module docstring.

    Use as a context manager or call `close()`. `score(calls)` takes (prompt, completion,
    fields) triples and returns a `RewardResult`; the runner stays usable after errors and
    timeouts. `startup_timeout_s` bounds a worker's start (imports included).
    """

    def __init__(
        self,
        reward_fn_spec: str,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        start_method: str = "forkserver",
        startup_timeout_s: float = 60.0,
    ) -> None:
        problems = []
        if not (isinstance(num_workers, int) and num_workers >= 0):
            problems.append(f"num_workers must be an integer >= 0 (0 = inline), got {num_workers!r}")
        if not (isinstance(timeout_s, int | float) and timeout_s > 0):
            problems.append(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if start_method not in START_METHODS:
            problems.append(f"start_method must be one of {sorted(START_METHODS)}, got {start_method!r}")
        if problems:
            raise ValueError("invalid RewardRunner settings: " + "; ".join(problems))
        self.spec = resolve_spec(reward_fn_spec)
        self.timeout_s, self.startup_timeout_s = float(timeout_s), startup_timeout_s
        self.workers_replaced = 0
        self._ctx = mp.get_context(start_method)
        self._inline_fn = load_reward(self.spec) if num_workers == 0 else None
        self._workers = [_Worker(self._ctx, self.spec) for _ in range(num_workers)]
        self._closed = False
        try:
            self._await_ready()
        except BaseException:
            self.close()
            raise

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def _await_ready(self) -> None:
        """Block until every starting worker reported ready; raise if one cannot load the reward."""
        deadline = time.monotonic() + self.startup_timeout_s
        for w in self._workers:
            if w.ready:
                continue
            if not w.conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(
                    f"reward worker for {self.spec!r} did not start within "
                    f"{self.startup_timeout_s} s; raise startup_timeout_s if its imports are slow"
                )
            try:
                kind, message = w.conn.recv()
            except EOFError:
                raise RuntimeError(
                    f"reward worker for {self.spec!r} exited during start-up "
                    f"(exit code {w.process.exitcode})"
                ) from None
            if kind == "init_error":
                raise RuntimeError(f"reward worker could not load {self.spec!r}: {message}")
            w.ready = True

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.spec)
        self.workers_replaced += 1

    def score(self, calls: Sequence[Call]) -> RewardResult:
        """Score every (prompt, completion, fields) call; see the module docstring."""
        if self._closed:
            raise RuntimeError("this RewardRunner is closed; create a new one")
        start = time.monotonic()
        result = RewardResult(rewards=[None] * len(calls), outcomes=["error"] * len(calls))
        if self._inline_fn is not None:
            for i, (prompt, completion, fields) in enumerate(calls):
                self._record(result, i, *score_one(self._inline_fn, prompt, completion, fields))
        else:
            self._score_in_workers(calls, result)
        result.seconds = time.monotonic() - start
        return result

    @staticmethod
    def _record(result: RewardResult, index: int, outcome: str, payload: Any) -> None:
        result.outcomes[index] = outcome
        if outcome == "ok":
            result.rewards[index] = payload
        elif outcome in ("error", "timeout"):
            result.errors[index] = payload

    def _score_in_workers(self, calls: Sequence[Call], result: RewardResult) -> None:
        pending = deque(range(len(calls)))
        remaining = len(calls)
        while remaining:
            self._await_ready()
            for w in list(self._workers):
                if w.index is None and pending:
                    w.index = pending.popleft()
                    w.deadline = time.monotonic() + self.timeout_s
                    try:
                        w.conn.send((w.index, calls[w.index]))
                    except (BrokenPipeError, ConnectionResetError):
                        # Died between calls: not this call's doing, so it goes back in line.
                        pending.appendleft(w.index)
                        self._replace(w)
            busy = [w for w in self._workers if w.index is not None]
            if not busy:
                continue
            nearest = min(w.deadline for w in busy)
            ready = wait([w.conn for w in busy], timeout=max(0.0, nearest - time.monotonic()))
            for w in busy:
                if w.conn in ready:
                    try:
                        index, (outcome, payload) = w.conn.recv()
                    except EOFError:
                        w.process.join(timeout=1.0)  # reap it, so the exit code is known
                        message = f"reward worker died (exit code {w.process.exitcode})"
                        self._record(result, w.index, "error", message)
                        self._replace(w)
                    else:
                        self._record(result, index, outcome, payload)
                        w.index, w.deadline = None, math.inf
                    remaining -= 1
                elif time.monotonic() >= w.deadline:
                    message = f"no answer within {self.timeout_s} s; worker killed and replaced"
                    self._record(result, w.index, "timeout", message)
                    self._replace(w)
                    remaining -= 1

    def close(self) -> None:
        """Stop the workers (politely, then by force after 5 s). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            if w.process.is_alive() and w.index is None:
                try:
                    w.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for w in self._workers:
            w.process.join(timeout=5.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
