"""One-step-off-policy rollouts (`train.async_rollouts`): the next step's batch is generated in
a background thread while the learner trains on this one.

Timeline with `train.async_staleness = 1` (W_t: the weights after t updates; the engines hold
W_t during step t, pushed at the end of step t - 1):

    step t:  take batch t (sampled by W_{t-1}; step 0: batch 0 by W_0, generated first)
             launch batch t + 1 on the engines, which hold W_t        -- background thread
             reward, old_logp (the learner at W_t), advantages, update -> W_{t+1}   -- main
             join batch t + 1, then push W_{t+1}                       -- main

So batch t >= 1 is sampled by version t - 1 and trained on by the learner at version t: the
staleness (`async/staleness`, step t's version minus the batch's) is 1 from step 1 on. The
push waits for the background generation, so the engines' weights never change under it;
an engine call is never made from two threads at once (evaluation and checkpoints run
between steps, when nothing is in flight). With `async_staleness = 0` the same path
generates batch t with W_t in the background and joins it at once: no overlap, and the
synchronous run's batches, updates and weights bit for bit (the worker thread runs with the
main thread's torch thread count, so every kernel splits its work as there).

Stop signals: the trainer honours a stop only before a step's update (qarl/train/signals.py).
The background generation checks for one before each decode step while the step may still
be abandoned; `commit()` (just before the update) ends that under a lock, so either the stop
was seen before the update and the main thread raises it too (the flag is sticky), or the
background generation runs to its end and the step finishes, the next check between steps
stopping the run with the generated batch in its checkpoint. A step that fails on the main
thread abandons the background call (`abandon`: the local engine stops at its next decode
step; a Ray call runs out) and waits for it; an error in the background generation surfaces
on the main thread at `finish()` (after that step's update, before its push; the run's last
checkpoint is intact).

Exact resume: `pending` is the batch of step `done` (sampled by W_{done-1}); a checkpoint of
`done` steps stores it (`pending_batch.safetensors`, `batch_tensors`), and a resumed run
trains on it instead of generating it again with W_done. The last step also generates the
batch after it where the final checkpoint is full, so a run extended with a larger
train.steps continues as the longer run would have.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from qarl.types import RolloutBatch

# RolloutBatch fields stored in a checkpoint as tensors; finish_reasons go in the metadata
_TENSORS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logp",
            "routed_experts", "kept_counts", "kept_ids")


class Abandoned(Exception):
    """Raised in the background generation when the main thread gave up the step."""


@dataclass
class Sampled:
    """A generated batch: for step `step`, sampled by weight version `version` (the number of
    updates the engine's weights had seen), in `seconds` of generation."""

    step: int
    version: int
    batch: RolloutBatch
    seconds: float


class AsyncRollouts:
    """The rollouts of a run with train.async_rollouts (module docstring). `generate(step,
    prompt_ids)` runs the engine (in the worker thread); `prompts(step)` gives the step's
    prompt ids (on the main thread); `stop_check` is the trainer's `check_stop`, which this
    object's `check` wraps for the engine."""

    def __init__(self, generate: Callable[[int, list[list[int]]], RolloutBatch],
                 prompts: Callable[[int], list[list[int]]], staleness: int,
                 stop_check: Callable[[], None]):
        self.generate, self.prompts, self.staleness = generate, prompts, staleness
        self.stop_check = stop_check
        self.pending: Sampled | None = None  # the batch of the next step to take
        self._next: Future | None = None  # the background generation in flight
        self._lock = threading.Lock()
        self._committed = False  # the step's update began: a stop waits for the step's end
        self._abandon = threading.Event()
        threads = torch.get_num_threads()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="qarl-rollouts",
                                          initializer=torch.set_num_threads,
                                          initargs=(threads,))
        self.waited = 0.0  # seconds the main thread waited on generation in the current step

    @property
    def in_flight(self) -> bool:
        return self._next is not None

    def check(self) -> None:
        """The engine's stop check: a stop signal ends a generation only while its step can
        still be abandoned; an abandoned step's background generation ends at once."""
        if self._abandon.is_set():
            raise Abandoned()
        with self._lock:
            if not self._committed:
                self.stop_check()

    def begin(self, step: int, launch_next: bool) -> Sampled:
        """The batch of `step`: the pending one, or generated now with the engine's weights
        (the first step, and every step with staleness 0); then, with staleness 1 and
        `launch_next`, the generation of step + 1's batch starts in the background."""
        self.waited, self._committed = 0.0, False
        self._abandon.clear()
        if self.pending is None or self.pending.step != step:
            self.pending = self._join(self._launch(step, version=step))
        taken = self.pending
        if self.staleness and launch_next:
            self._next = self._launch(step + 1, version=step)
        return taken

    def commit(self) -> None:
        """Just before the update: the last point where a stop signal ends the step (raised
        here as on the main thread); from now on the background generation runs to its end."""
        with self._lock:
            self._committed = True
            self.stop_check()

    def finish(self) -> None:
        """After the update, before the push: wait for the background generation (its error,
        if it raised, raised here) and make its batch the pending one."""
        if self._next is not None:
            future, self._next = self._next, None
            self.pending = self._join(future)
        self._committed = False

    def abandon(self) -> None:
        """The step failed on the main thread: stop the background generation and wait for
        it; its result or error is dropped."""
        self._committed = False
        if self._next is None:
            return
        future, self._next = self._next, None
        self._abandon.set()
        try:
            future.result()
        except BaseException:  # noqa: BLE001 - the step's own error is the one raised
            pass
        self._abandon.clear()

    def close(self) -> None:
        self.abandon()
        self._worker.shutdown(wait=True)

    def _launch(self, step: int, version: int) -> Future:
        prompt_ids = self.prompts(step)

        def run() -> Sampled:
            began = time.perf_counter()
            batch = self.generate(step, prompt_ids)
            return Sampled(step, version, batch, time.perf_counter() - began)

        return self._worker.submit(run)

    def _join(self, future: Future) -> Sampled:
        began = time.perf_counter()
        try:
            return future.result()
        finally:
            self.waited += time.perf_counter() - began

    # ---- checkpoints ----------------------------------------------------------------------

    def state(self, done: int) -> tuple[dict, tuple[dict[str, Tensor], dict[str, str]] | None]:
        """What a checkpoint of `done` steps keeps: (state.json's entry, the pending batch's
        tensors and metadata, or None where no batch for step `done` was generated yet)."""
        if self.pending is None or self.pending.step != done:
            return {"pending": None}, None
        info = {"step": done, "version": self.pending.version, "seconds": self.pending.seconds}
        return {"pending": info}, batch_tensors(self.pending.batch)

    def restore(self, state: dict, saved: tuple[dict[str, Tensor], dict[str, str]] | None
                ) -> None:
        """The pending batch of a checkpoint (`state`'s entry and the saved tensors)."""
        info = state.get("pending")
        if info is None or saved is None:
            self.pending = None
            return
        self.pending = Sampled(info["step"], info["version"], batch_from_tensors(*saved),
                               info["seconds"])


def batch_tensors(batch: RolloutBatch) -> tuple[dict[str, Tensor], dict[str, str]]:
    """A RolloutBatch as safetensors content: its tensors (on the CPU, contiguous) and its
    finish reasons as metadata (comma-separated)."""
    tensors = {name: getattr(batch, name).detach().cpu().contiguous() for name in _TENSORS
               if getattr(batch, name) is not None}
    return tensors, {"finish_reasons": ",".join(batch.finish_reasons)}


def batch_from_tensors(tensors: dict[str, Tensor], metadata: dict[str, str]) -> RolloutBatch:
    """The inverse of `batch_tensors`."""
    reasons = metadata.get("finish_reasons", "")
    return RolloutBatch(**{name: tensors.get(name) for name in _TENSORS},
                        finish_reasons=reasons.split(",") if reasons else [])
