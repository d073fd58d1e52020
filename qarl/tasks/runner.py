"""The reward runner: score completions in worker processes, each call under a deadline.

`RewardRunner(spec, num_workers, timeout_s)` keeps a pool of worker processes alive between
steps. Each worker imports the reward once (at start, before any deadline runs), then serves
one call at a time over its own pipe. Every call ends in exactly one outcome:

  ok          the reward returned a finite number
  unscorable  the reward returned None
  error       the reward raised, returned something that is not a finite number, or its
              worker died (e.g. `os._exit`), or the call's fields are not JSON values;
              the message is kept in `RewardResult.errors`
  timeout     no answer within timeout_s of the call reaching the worker; the worker is
              killed and replaced, the other calls go on

Rewards of error/timeout calls are None (never a silent 0); the counts come back with them,
and so does the number of workers replaced. Workers are fresh interpreters speaking JSON
(see `qarl.tasks.worker`), not forks: safe when the parent has torch loaded, the parent's
`__main__` is never re-imported, and nothing is unpickled. `stop_check`, called while
waiting, may raise to abandon a batch (the trainer's SIGTERM / SIGINT check); workers left
busy are replaced before the next batch.
`num_workers=0` scores inline in the calling process (no process start-up; exceptions are still
counted, but deadlines cannot be enforced): for tests and debugging.

Batched rewards (`batched=True`, the recipe's `task.reward_batch`): the reward takes lists,
`fn(prompts, completions, **fields) -> sequence of float | None` with each field a list (None
where a call lacks it), and `score` makes one call of it per batch, in one worker, under the
same deadline. Each returned value gets its own outcome as above; a batch call that raises,
returns something other than one value per completion, dies or times out gives every call of
the batch that outcome (`error` or `timeout`) and message, counted per call.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from qarl.tasks.rewards import load_reward, resolve_spec
from qarl.tasks.worker import (
    ENTRY,
    batch_fields,
    encode_batch,
    encode_call,
    receive,
    score_batch,
    score_one,
    send,
)

OUTCOMES = ("ok", "unscorable", "error", "timeout")
POLL_S = 0.1  # longest wait between two `stop_check` calls

Call = tuple[str, str, dict[str, Any]]  # (prompt, completion, reward fields)
Job = tuple[list[int], bytes]  # (the call indices one message scores, the message)


@dataclass
class RewardResult:
    """Rewards of one batch of calls, in call order, with the outcome of each."""

    rewards: list[float | None]
    outcomes: list[str]  # one of OUTCOMES per call
    errors: dict[int, str] = field(default_factory=dict)  # call index -> message (error/timeout)
    seconds: float = 0.0  # wall time of the batch
    workers_replaced: int = 0  # workers killed (timeout) or found dead, and restarted

    @property
    def counts(self) -> dict[str, int]:
        """Number of calls per outcome (every outcome present, zeros included)."""
        return {o: self.outcomes.count(o) for o in OUTCOMES}


class _Worker:
    """One worker process (see `qarl.tasks.worker`), its pipes, and its call in flight."""

    def __init__(self, spec: str) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", ENTRY, str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self.outbox = Connection(to_child_w, readable=False)
        self.inbox = Connection(from_child_r, writable=False)
        send(self.outbox, {"spec": spec, "sys_path": list(sys.path)})
        self.ready = False
        self.index: int | None = None  # job in flight
        self.deadline = math.inf

    def exit_code(self) -> int | None:
        """The exit code once the process has ended (waits up to 1 s for it), else None."""
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Stop the process at once and close its pipes."""
        self.process.kill()
        self.process.wait()
        self.inbox.close()
        self.outbox.close()


class RewardRunner:
    """A persistent pool of reward workers; see the module docstring.

    Use as a context manager or call `close()`. `score(calls)` takes (prompt, completion,
    fields) triples and returns a `RewardResult`; the runner stays usable after errors and
    timeouts. `startup_timeout_s` bounds a worker's start (imports included); `batched`: the
    reward takes lists, one call per `score` (module docstring).
    """

    def __init__(
        self,
        reward_fn_spec: str,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        startup_timeout_s: float = 60.0,
        batched: bool = False,
    ) -> None:
        problems = []
        if not (isinstance(num_workers, int) and num_workers >= 0):
            problems.append(
                f"num_workers must be an integer >= 0 (0 = inline), got {num_workers!r}"
            )
        if not (isinstance(timeout_s, int | float) and timeout_s > 0):
            problems.append(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if problems:
            raise ValueError("invalid RewardRunner settings: " + "; ".join(problems))
        self.spec = resolve_spec(reward_fn_spec)
        self.timeout_s, self.startup_timeout_s = float(timeout_s), startup_timeout_s
        self.batched = batched
        self.workers_replaced = 0
        self.stop_check: Callable[[], None] = lambda: None
        self._inline_fn = load_reward(self.spec) if num_workers == 0 else None
        self._workers = [_Worker(self.spec) for _ in range(num_workers)]
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
            while not w.inbox.poll(min(POLL_S, max(0.0, deadline - time.monotonic()))):
                self.stop_check()
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"reward worker for {self.spec!r} did not start within "
                        f"{self.startup_timeout_s} s; raise startup_timeout_s if its imports "
                        "are slow"
                    )
            try:
                message = receive(w.inbox)
            except EOFError:
                raise RuntimeError(
                    f"reward worker for {self.spec!r} exited during start-up "
                    f"(exit code {w.exit_code()})"
                ) from None
            if "init_error" in message:
                raise RuntimeError(f"reward worker could not load {self.spec!r}: "
                                   f"{message['init_error']}")
            w.ready = True

    def _replace(self, worker: _Worker, result: RewardResult | None = None) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self.spec)
        self.workers_replaced += 1
        if result is not None:
            result.workers_replaced += 1

    def score(self, calls: Sequence[Call]) -> RewardResult:
        """Score every (prompt, completion, fields) call; see the module docstring."""
        if self._closed:
            raise RuntimeError("this RewardRunner is closed; create a new one")
        start = time.monotonic()
        result = RewardResult(rewards=[None] * len(calls), outcomes=["error"] * len(calls))
        messages = {}
        for i, call in enumerate(calls):
            try:
                messages[i] = encode_call(i, *call)
            except (TypeError, ValueError) as e:
                self._record(result, i, "error", f"reward fields are not JSON values: {e}")
        if self.batched:
            self._score_batch([i for i in messages], calls, result)
        elif self._inline_fn is not None:
            for i, message in messages.items():
                self.stop_check()
                job = json.loads(message)
                self._record(result, i, *score_one(self._inline_fn, job["prompt"],
                                                   job["completion"], job["fields"]))
        else:
            self._score_in_workers({i: ([i], message) for i, message in messages.items()},
                                   result)
        result.seconds = time.monotonic() - start
        return result

    def _score_batch(self, indices: list[int], calls: Sequence[Call],
                     result: RewardResult) -> None:
        """The calls at `indices` (those whose fields are JSON) as one call of a batched
        reward."""
        if not indices:
            return
        prompts = [calls[i][0] for i in indices]
        completions = [calls[i][1] for i in indices]
        fields = batch_fields([calls[i][2] for i in indices])
        if self._inline_fn is not None:
            self.stop_check()
            self._record_job(result, indices, score_batch(self._inline_fn, prompts, completions,
                                                          json.loads(json.dumps(fields))))
        else:
            self._score_in_workers({0: (indices, encode_batch(0, prompts, completions,
                                                              fields))}, result)

    def _record_job(self, result: RewardResult, indices: list[int],
                    scored: tuple[str, Any] | list[tuple[str, Any]]) -> None:
        """Record a job's answer: one (outcome, value) per call, or one for all its calls."""
        if isinstance(scored, tuple):
            scored = [scored] * len(indices)
        for index, (outcome, value) in zip(indices, scored, strict=True):
            self._record(result, index, outcome, value)

    @staticmethod
    def _record(result: RewardResult, index: int, outcome: str, payload: Any) -> None:
        result.outcomes[index] = outcome
        if outcome == "ok":
            result.rewards[index] = payload
        elif outcome in ("error", "timeout"):
            result.errors[index] = payload

    def _score_in_workers(self, jobs: dict[int, Job], result: RewardResult) -> None:
        """Send each job (one message, scoring one call or a batch of calls) to a free worker;
        record its answer, or the timeout / death of its worker for each of its calls."""
        for w in list(self._workers):
            if w.index is not None:  # left busy by a score() that raised: its answer is stale
                self._replace(w)
        pending = deque(jobs)
        remaining = len(jobs)
        while remaining:
            self._await_ready()
            for w in list(self._workers):
                if w.index is None and pending:
                    w.index = pending.popleft()
                    w.deadline = time.monotonic() + self.timeout_s
                    try:
                        w.outbox.send_bytes(jobs[w.index][1])
                    except (BrokenPipeError, ConnectionResetError):
                        # Died between calls: not this job's doing, so it goes back in line.
                        pending.appendleft(w.index)
                        self._replace(w, result)
            busy = [w for w in self._workers if w.index is not None]
            if not busy:
                continue
            nearest = min(w.deadline for w in busy)
            ready = wait([w.inbox for w in busy],
                         timeout=min(POLL_S, max(0.0, nearest - time.monotonic())))
            self.stop_check()
            for w in busy:
                if w.inbox in ready:
                    remaining -= self._collect(w, jobs[w.index][0], result)
                elif time.monotonic() >= w.deadline:
                    message = f"no answer within {self.timeout_s} s; worker killed and replaced"
                    self._record_job(result, jobs[w.index][0], ("timeout", message))
                    self._replace(w, result)
                    remaining -= 1

    def _collect(self, w: _Worker, indices: list[int], result: RewardResult) -> int:
        """Record the answer of a worker whose pipe is readable (for the calls at `indices`);
        1 (one job done)."""
        try:
            answer = receive(w.inbox)
        except EOFError:
            message = f"reward worker died (exit code {w.exit_code()})"
            self._record_job(result, indices, ("error", message))
            self._replace(w, result)
        else:
            if "results" in answer:
                self._record_job(result, indices, [tuple(pair) for pair in answer["results"]])
            else:
                self._record_job(result, indices, (answer["outcome"], answer["value"]))
            w.index, w.deadline = None, math.inf
        return 1

    def close(self) -> None:
        """Stop the workers: idle ones politely (by force after 5 s), busy ones at once.
        Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        asked = []
        for w in self._workers:
            if w.process.poll() is None and w.index is None:
                try:
                    send(w.outbox, None)
                    asked.append(w)
                except (BrokenPipeError, OSError):
                    pass
        for w in self._workers:
            if w in asked:
                try:
                    w.process.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    pass
            w.kill()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
