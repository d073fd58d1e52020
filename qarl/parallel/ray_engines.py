"""`RayEngines`: N rollout engines in Ray actors behind the one `qarl.rollout.Engine` protocol.

Each actor builds its own engine with the factory it is given, called with the actor's index
(the trainer passes the function that builds its in-process engine, local or vLLM, so every
actor runs the same decode path; a vLLM actor writes its starting policy into its own
folder), and the trainer talks to `RayEngines` as it talks to one engine:

- `generate` splits the prompts into N contiguous shards (`shard_bounds`), runs them in
  parallel and joins the results in prompt order. Shard k is generated with
  `row_offset` = its first row and `prompt_width` = the whole batch's, so each response
  draws from its own random stream and every shard pads like the whole batch: the joined
  batch equals one engine's batch bit for bit (torch.equal), not just in distribution.
- `load_weights` puts the state in Ray's object store once (`ray.put`) and hands every actor
  the same reference: the learner serializes its codes and scales once per step, whatever N.
  Where the actors' engines take weight deltas (`DeltaLoader`, the local engine's), so does
  `RayEngines`: `load_delta` puts the changed codes and scales and the delta's whole tensors
  once, as two objects, and each actor applies them to the version it holds.
- Faults: an actor that dies is restarted by Ray (`max_restarts`); its shard is resubmitted
  after the last pushed weights are reinstalled, with the same seed and row offset, so the
  step's tokens do not change. `restarts` counts the resubmissions. The weights reinstalled
  are the last whole state and what was pushed after it: the adapters of a LoRA run, or
  every delta since, in order (each delta's whole tensors superseded by the last one's, so
  the object store holds the last whole state, the deltas' changed codes and one copy of
  the other tensors; the weight sync bounds the deltas' bytes: qarl/train/sync.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError
from torch import Tensor

from qarl.quant import QWeight
from qarl.quant.delta import StateDelta
from qarl.types import RolloutBatch, SamplingParams, concat_batches

_RESTART_TIMEOUT_S = 300  # a restarted actor rebuilds its engine: loads and quantizes the model
# Starting the actors: building an engine takes seconds to minutes; waiting longer means the
# cluster has no room for them (Ray queues an actor until its CPUs / GPUs are free).
_START_TIMEOUT_S = 600


def shard_bounds(num_rows: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) row ranges, sizes differing by at most one, the larger first;
    no empty shard (fewer shards when there are fewer rows)."""
    shards = min(num_shards, num_rows)
    base, extra = divmod(num_rows, shards)
    bounds, start = [], 0
    for k in range(shards):
        end = start + base + (k < extra)
        bounds.append((start, end))
        start = end
    return bounds


class EngineWorker:
    """One rollout engine in a Ray actor process (the body of each of RayEngines' actors)."""

    def __init__(self, factory: Callable[[int], object], index: int):
        self.engine = factory(index)

    def generate(self, prompt_ids, sampling, seed, row_offset, prompt_width) -> RolloutBatch:
        return self.engine.generate(prompt_ids, sampling, seed, row_offset=row_offset,
                                    prompt_width=prompt_width)

    def score(self, batch: RolloutBatch, sampling: SamplingParams) -> Tensor:
        return self.engine.score(batch, sampling)

    def load_weights(self, state: dict, partial: bool = False) -> None:
        # an engine that takes no partial state is asked for whole ones only (WeightSync.push)
        if partial:
            self.engine.load_weights(state, partial=True)
        else:
            self.engine.load_weights(state)

    def takes_deltas(self) -> bool:
        return self.engine.delta_loader() is not None

    def versions(self) -> list[int | None]:
        return self.engine.delta_loader().versions()

    def load_versioned(self, state: dict, version: int) -> None:
        self.engine.delta_loader().load_versioned(state, version)

    def load_delta(self, codes: StateDelta, tensors: dict) -> None:
        """`codes`: the delta without its whole tensors, which come as `tensors` (the last
        delta's, when a restarted actor replays older deltas)."""
        self.engine.delta_loader().load_delta(
            StateDelta(codes.base, codes.version, codes.qweights, tensors))

    def describe(self) -> dict[str, str]:
        return self.engine.describe()

    def pad_token_id(self) -> int:
        return self.engine.pad_token_id

    def qweights(self) -> dict[str, QWeight]:
        """The codes and scales this engine decodes with, per quantized layer."""
        return self.engine.qweights()

    def weight_digests(self) -> list[dict[str, tuple[int, ...]]]:
        return self.engine.weight_digests()

    def release_caches(self) -> None:
        self.engine.release_caches()

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class RayEngines:
    """`num_workers` engines, actor k's built by `factory(k)` in that actor; implements
    `qarl.rollout.Engine`. Needs a connected Ray (`qarl.parallel.connect`). Each actor reserves
    `cpus_per_worker` CPUs (Ray sets its torch threads to that) and `gpus_per_worker` GPUs."""

    # Called before each generate / score is dispatched (the trainer's stop-signal check).
    stop_check: Callable[[], None] = staticmethod(lambda: None)

    def __init__(self, factory: Callable[[int], object], num_workers: int, max_restarts: int = 3,
                 cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 start_timeout_s: float = _START_TIMEOUT_S):
        actor = ray.remote(EngineWorker).options(
            max_restarts=max_restarts, num_cpus=cpus_per_worker, num_gpus=gpus_per_worker)
        self.workers = [actor.remote(factory, k) for k in range(num_workers)]
        self.max_restarts = max_restarts
        pads = [worker.pad_token_id.remote() for worker in self.workers]
        done, waiting = ray.wait(pads, num_returns=len(pads), timeout=start_timeout_s)
        if waiting:
            self.close()
            raise RuntimeError(
                f"{len(waiting)} of {num_workers} rollout workers did not start within "
                f"{start_timeout_s:.0f} s: each needs {cpus_per_worker} CPU and "
                f"{gpus_per_worker} GPU free on one node of the cluster; see `ray status`, or "
                "lower dist.rollout_workers")
        self.pad_token_id: int = ray.get(pads[0])
        self._takes_deltas: bool = ray.get(self.workers[0].takes_deltas.remote())
        # DeltaLoader.crosses_machines: an actor on another node than this process
        here = ray.get_runtime_context().get_node_id()
        self.crosses_machines = any(
            node != here for node in ray.get([w.node_id.remote() for w in self.workers]))
        self.restarts = 0
        # ObjectRefs reinstalled after a restart: the last whole state pushed (with its
        # version, None when pushed without one), and after it the last partial one (a LoRA
        # run's adapters) or the deltas since (their codes in order, the last one's tensors)
        self._weights = self._partial = self._tensors = None
        self._version: int | None = None
        self._deltas: list = []

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int,
                 row_offset: int = 0, prompt_width: int = 0) -> RolloutBatch:
        """`Engine.generate` over the actors: shard k (rows [a, b)) runs on actor k with
        row_offset + a and the batch's prompt width; the shards are joined in order."""
        if not prompt_ids:
            raise ValueError("generate() got an empty prompt list; pass at least one prompt")
        self.stop_check()
        width = max(prompt_width, *(len(p) for p in prompt_ids))
        bounds = shard_bounds(len(prompt_ids), len(self.workers))
        batches = self._run([
            (k, "generate", (prompt_ids[a:b], sampling, seed, row_offset + a, width))
            for k, (a, b) in enumerate(bounds)
        ])
        return concat_batches(batches, self.pad_token_id)

    def score(self, batch: RolloutBatch, sampling: SamplingParams) -> Tensor:
        """`Engine.score` over the actors, row shards of the batch (same prompt and response
        widths), joined in order: [N, L] float32."""
        self.stop_check()
        bounds = shard_bounds(batch.num_sequences, len(self.workers))
        parts = self._run([(k, "score", (batch.select(torch.arange(a, b)), sampling))
                           for k, (a, b) in enumerate(bounds)])
        return torch.cat(parts)

    def load_weights(self, state: dict, partial: bool = False) -> None:
        """One `ray.put` of the state; every actor installs it from the object store."""
        ref = ray.put(state)
        if partial:
            self._partial = ref
        else:
            self._weights, self._partial, self._version = ref, None, None
            self._deltas, self._tensors = [], None
        self._run([(k, "load_weights", (ref, partial)) for k in range(len(self.workers))])

    def delta_loader(self) -> "RayEngines | None":
        """Itself where the actors' engines take deltas (`DeltaLoader`), else None."""
        return self if self._takes_deltas else None

    def versions(self) -> list[int | None]:
        """`DeltaLoader.versions`: every actor's, in actor order."""
        per_actor = self._run([(k, "versions", ()) for k in range(len(self.workers))])
        return [v for versions in per_actor for v in versions]

    def load_versioned(self, state: dict, version: int) -> None:
        """`DeltaLoader.load_versioned`: one `ray.put`, as `load_weights`."""
        ref = ray.put(state)
        self._weights, self._partial, self._version = ref, None, version
        self._deltas, self._tensors = [], None
        self._run([(k, "load_versioned", (ref, version)) for k in range(len(self.workers))])

    def load_delta(self, delta: StateDelta) -> None:
        """`DeltaLoader.load_delta`: the changed codes and the whole tensors, one `ray.put`
        each; every actor applies them to the version it holds."""
        codes = ray.put(StateDelta(delta.base, delta.version, delta.qweights))
        self._deltas.append(codes)
        self._tensors = ray.put(delta.tensors)
        self._run([(k, "load_delta", (codes, self._tensors)) for k in range(len(self.workers))])

    def describe(self) -> dict[str, str]:
        return self._run([(0, "describe", ())])[0]

    def qweights(self) -> dict[str, QWeight]:
        """The codes and scales the engines decode with (actor 0's; they all hold the same)."""
        return self._run([(0, "qweights", ())])[0]

    def weight_digests(self) -> list[dict[str, tuple[int, ...]]]:
        """`Engine.weight_digests`: every actor's own, computed in the actor (digests travel,
        not weights), in actor order."""
        per_actor = self._run([(k, "weight_digests", ()) for k in range(len(self.workers))])
        return [d for digests in per_actor for d in digests]

    def release_caches(self) -> None:
        """`Engine.release_caches` in every actor."""
        self._run([(k, "release_caches", ()) for k in range(len(self.workers))])

    def close(self) -> None:
        """End the actors (their CPUs / GPUs go back to the cluster)."""
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []

    def _run(self, calls: Sequence[tuple[int, str, tuple]]) -> list:
        """Run (actor index, method, args) calls in parallel; results in call order. A call
        whose actor died is resubmitted to the restarted actor, after the last weights are
        reinstalled, up to max_restarts times per call."""
        pending = {i: self._submit(*call) for i, call in enumerate(calls)}
        results: dict[int, object] = {}
        tries = dict.fromkeys(pending, 0)
        while pending:
            i, ref = next(iter(pending.items()))
            try:
                results[i] = ray.get(ref)
                del pending[i]
            except RayActorError as error:
                k, method, _ = calls[i]
                tries[i] += 1
                if tries[i] > self.max_restarts:
                    raise RuntimeError(
                        f"rollout worker {k} died during {method}() {tries[i]} times, more "
                        f"than its max_restarts={self.max_restarts}; see the Ray logs "
                        "(/tmp/ray/session_latest/logs) for why") from error
                self.restarts += 1
                self._wait_until_alive(k)
                self._reinstall(k, method)
                pending[i] = self._submit(*calls[i])
        return [results[i] for i in range(len(calls))]

    def _reinstall(self, k: int, method: str) -> None:
        """A restarted actor k gets the weights the others hold (before its call is
        resubmitted): the last whole state, then the adapters pushed after it or every delta
        since (a failed delta push itself included: resubmitted, it finds its version there
        and takes nothing); a failed partial push itself is resubmitted after the whole
        state only."""
        whole = method in ("load_weights", "load_versioned")
        if self._weights is None or (whole and self._partial is None):
            return  # nothing pushed yet, or the failed call is the whole push itself
        worker = self.workers[k]
        if self._version is None:
            ray.get(worker.load_weights.remote(self._weights))
        else:
            ray.get(worker.load_versioned.remote(self._weights, self._version))
        for codes in self._deltas:
            ray.get(worker.load_delta.remote(codes, self._tensors))
        if self._partial is not None and method != "load_weights":
            ray.get(worker.load_weights.remote(self._partial, True))

    def _wait_until_alive(self, k: int) -> None:
        """Block until Ray has restarted actor k (its constructor rebuilt the engine)."""
        deadline = time.monotonic() + _RESTART_TIMEOUT_S
        while True:
            try:
                ray.get(self.workers[k].pid.remote())
                return
            except ActorUnavailableError:  # restarting: its constructor is still running
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"rollout worker {k} did not come back within {_RESTART_TIMEOUT_S} s "
                        "of dying; see the Ray logs (/tmp/ray/session_latest/logs)") from None
                time.sleep(0.2)
            except RayActorError as error:  # dead for good: its restarts are used up
                raise RuntimeError(
                    f"rollout worker {k} died and Ray did not restart it (max_restarts="
                    f"{self.max_restarts} used up?); see the Ray logs "
                    "(/tmp/ray/session_latest/logs)") from error

    def _submit(self, k: int, method: str, args: tuple):
        return getattr(self.workers[k], method).remote(*args)
