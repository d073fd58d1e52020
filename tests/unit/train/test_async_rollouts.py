"""`AsyncRollouts` with a stand-in engine: which weights sample which step's batch, how stops
and errors in the background generation reach the main thread, and the pending batch in a
checkpoint (safetensors, exact)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from qarl.train import checkpoint
from qarl.train.async_rollouts import (
    Abandoned, AsyncRollouts, batch_from_tensors, batch_tensors,
)
from qarl.train.signals import StopRequested
from qarl.types import RolloutBatch


def _batch(step: int, version: int, kept: bool = False) -> RolloutBatch:
    """A 2-row batch whose logprobs encode (step, version): -(10 step + version)."""
    logp = torch.full((2, 3), -float(10 * step + version))
    counts = torch.tensor([[2, 1, 0], [1, 1, 1]], dtype=torch.int32) if kept else None
    return RolloutBatch(
        prompt_ids=torch.tensor([[0, 5], [6, 7]]), prompt_mask=torch.tensor([[0, 1], [1, 1]]).bool(),
        response_ids=torch.tensor([[1, 2, 0], [3, 4, 5]]),
        response_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]).bool(), rollout_logp=logp,
        finish_reasons=["stop", "length"], kept_counts=counts,
        kept_ids=torch.arange(6, dtype=torch.int32) if kept else None)


class FakeEngine:
    """Generates batches labelled with the weight version it holds; `decode_steps` calls of
    its stop check per generation (as the local engine's before each decode step)."""

    def __init__(self, decode_steps: int = 3, delay: float = 0.0):
        self.version, self.decode_steps, self.delay = 0, decode_steps, delay
        self.stop_check = lambda: None
        self.fail = False
        self.started = threading.Event()

    def generate(self, step: int, prompt_ids) -> RolloutBatch:
        version = self.version
        self.started.set()
        for _ in range(self.decode_steps):
            self.stop_check()
            time.sleep(self.delay)
        if self.fail:
            raise ValueError("engine failed")
        return _batch(step, version)


def _rollouts(engine: FakeEngine, staleness: int = 1, stop=lambda: None) -> AsyncRollouts:
    rollouts = AsyncRollouts(engine.generate, lambda step: [[step]], staleness, stop)
    engine.stop_check = rollouts.check
    return rollouts


def _run_step(rollouts: AsyncRollouts, engine: FakeEngine, step: int):
    taken = rollouts.begin(step, launch_next=True)
    rollouts.commit()
    rollouts.finish()
    engine.version += 1  # the push of the update's weights
    return taken


@pytest.mark.parametrize("staleness", [0, 1])
def test_step_t_is_sampled_by_version_t_minus_staleness(staleness):
    """Staleness 1: batch 0 by version 0, batch t >= 1 by version t - 1 (generated during
    step t - 1, before its push). Staleness 0: batch t by version t."""
    engine = FakeEngine()
    rollouts = _rollouts(engine, staleness)
    taken = [_run_step(rollouts, engine, step) for step in range(4)]
    rollouts.close()
    expected = [0, 0, 1, 2] if staleness else [0, 1, 2, 3]
    assert [s.version for s in taken] == expected
    assert [s.step for s in taken] == [0, 1, 2, 3]
    assert [float(s.batch.rollout_logp[0, 0]) for s in taken] == [
        -(10 * step + v) for step, v in enumerate(expected)]


def test_the_worker_thread_uses_the_main_threads_torch_threads():
    """The background thread runs with the main thread's torch thread count, so its kernels
    split their work as a synchronous run's do."""
    seen = []
    rollouts = AsyncRollouts(lambda step, ids: seen.append(torch.get_num_threads()) or
                             _batch(step, 0), lambda step: [[step]], 0, lambda: None)
    rollouts.begin(0, launch_next=True)
    rollouts.close()
    assert seen == [torch.get_num_threads()]


def test_a_stop_before_the_update_surfaces_on_the_main_thread_and_keeps_the_batch():
    """A stop signal seen by the background generation before the update: the main thread's
    commit raises it too (the flag is sticky), and the pending batch is still the step's own
    (what the checkpoint of the finished steps stores)."""
    engine = FakeEngine(decode_steps=50, delay=0.01)
    stopped = threading.Event()

    def stop():
        if stopped.is_set():
            raise StopRequested(15)

    rollouts = _rollouts(engine, stop=stop)
    rollouts.begin(0, launch_next=True)
    engine.started.wait(5)
    stopped.set()
    with pytest.raises(StopRequested):
        rollouts.commit()
    rollouts.abandon()
    assert not rollouts.in_flight and rollouts.pending.step == 0
    state, saved = rollouts.state(0)
    assert state["pending"]["step"] == 0 and saved is not None
    rollouts.close()


def test_a_stop_during_the_update_lets_the_generation_finish():
    """After commit (the update runs) a stop signal no longer ends the background
    generation: the step finishes with the next batch, which the next stop check saves."""
    engine = FakeEngine(decode_steps=20, delay=0.01)
    stopped = threading.Event()

    def stop():
        if stopped.is_set():
            raise StopRequested(15)

    rollouts = _rollouts(engine, stop=stop)
    rollouts.begin(0, launch_next=True)
    rollouts.commit()
    stopped.set()
    rollouts.finish()
    assert rollouts.pending.step == 1 and rollouts.pending.version == 0
    rollouts.close()


def test_an_error_in_the_background_surfaces_at_finish():
    """An engine error in the background generation is raised on the main thread by finish
    (after the step's update, before its push), as itself."""
    engine = FakeEngine()
    rollouts = _rollouts(engine)
    rollouts.begin(0, launch_next=False)
    engine.fail = True
    rollouts._next = rollouts._launch(1, version=0)
    rollouts.commit()
    with pytest.raises(ValueError, match="engine failed"):
        rollouts.finish()
    assert not rollouts.in_flight and rollouts.pending.step == 0
    rollouts.close()


def test_abandon_stops_the_background_generation_at_its_next_check():
    """A step that fails on the main thread: the background generation ends at its next stop
    check (Abandoned, dropped) and abandon returns at once, not after the whole generation."""
    engine = FakeEngine(delay=0.01)
    rollouts = _rollouts(engine)
    rollouts.begin(0, launch_next=False)
    engine.started.clear()
    engine.decode_steps = 1000  # 10 s unless abandoned
    rollouts._next = rollouts._launch(1, version=0)
    engine.started.wait(5)
    began = time.perf_counter()
    rollouts.abandon()
    assert time.perf_counter() - began < 2.0
    assert not rollouts.in_flight
    rollouts.check()  # the next step's generations are not abandoned
    with pytest.raises(Abandoned):
        rollouts._abandon.set()
        rollouts.check()
    rollouts._abandon.clear()
    rollouts.close()


@pytest.mark.parametrize("kept", [False, True])
def test_batch_tensors_round_trip_exactly(kept):
    """A batch (with kept sets or not) through batch_tensors and back: every tensor equal in
    dtype and bits, the finish reasons in order."""
    batch = _batch(3, 2, kept)
    back = batch_from_tensors(*batch_tensors(batch))
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logp",
                 "kept_counts", "kept_ids", "routed_experts"):
        a, b = getattr(batch, name), getattr(back, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
    assert back.finish_reasons == batch.finish_reasons


def test_a_checkpoint_keeps_the_pending_batch_and_needs_it(tmp_path):
    """A checkpoint saved with a pending batch gives it back bit for bit (safetensors, its
    finish reasons in the metadata); one that names a pending batch and lost the file is not
    whole (passed over on resume); one saved without loads none."""
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    engine = FakeEngine()
    rollouts = _rollouts(engine)
    _run_step(rollouts, engine, 0)
    state, pending = rollouts.state(1)
    folder = checkpoint.save(tmp_path, 1, model, [opt], {"async": state},
                             checkpoint.capture_rng(), "", keep=3, pending=pending)
    assert checkpoint.problem(folder) is None
    restored = _rollouts(FakeEngine())
    loaded, _ = checkpoint.load(folder, model, [opt])
    restored.restore(loaded["async"], checkpoint.load_pending(folder))
    assert (restored.pending.step, restored.pending.version) == (1, 0)
    assert torch.equal(restored.pending.batch.rollout_logp, rollouts.pending.batch.rollout_logp)
    assert restored.pending.batch.finish_reasons == ["stop", "length"]
    plain = checkpoint.save(tmp_path, 2, model, [opt], {}, checkpoint.capture_rng(), "", keep=3)
    assert checkpoint.load_pending(plain) is None and checkpoint.problem(plain) is None
    (folder / checkpoint.PENDING).unlink()
    assert "pending_batch.safetensors" in checkpoint.problem(folder)
    rollouts.close()
    restored.close()
