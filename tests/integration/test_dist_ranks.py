"""[dist] learner ranks on `tiny`: two gloo ranks make the update of one, whether the second
rank is a local process or a Ray actor."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qarl.train import train
from qarl.train.guards import TrainingAborted
from qarl.train.checkpoint import latest
from rank_weights import FLOAT_BACKWARD, assert_weights_agree

# FSDP vs replicated ranks: the same micro-batches on the same ranks, so the same summed
# gradients (a + b is exact in either order); only the global gradient norm is summed in
# another order (over shards), moving the clip coefficient by ~1e-7 relative. With the float
# backward (OVERRIDES: rank_weights.FLOAT_BACKWARD) that moves the weights by ~1e-7 per
# optimizer step; six of them here (3 steps x 2 epochs). 7e-6 leaves room for that and is
# still 3x tighter than the one-rank tolerance.
FSDP_TOLERANCE = 7e-6


OVERRIDES = {"train.steps": 3, "rollout.batch_size": 16, "train.micro_batch_size": 4,
             "eval.size": 4, "eval.full_precision": False, **FLOAT_BACKWARD}


@pytest.fixture(scope="module")
def final_weights(tmp_path_factory):
    """`final_weights(ranks, placement, strategy, epochs, file)`: a checkpoint file's tensors
    after OVERRIDES' 3 steps, each arm trained once per module."""
    out, done = tmp_path_factory.mktemp("ranks"), {}

    def run(ranks: int, placement: str = "local", strategy: str = "replicate", epochs: int = 1,
            file: str = "model.safetensors", lora: int = 0) -> dict[str, torch.Tensor]:
        name = f"ranks{ranks}-{placement}-{strategy}-epochs{epochs}-lora{lora}"
        if name not in done:
            train("tiny", {**OVERRIDES, "run.output_dir": str(out), "run.name": name,
                           "algo.epochs": epochs, "dist.learner_ranks": ranks,
                           "dist.learner_placement": placement, "dist.learner_strategy": strategy,
                           "lora.rank": lora})
            done[name] = latest(out / name)
        return load_file(done[name] / file)

    return run


def test_two_learner_ranks_give_the_weights_of_one(final_weights):
    """tiny, 3 steps, 4 micro-batches per step: learner_ranks = 2 (each rank 2 micro-batches,
    gradients all-reduced) ends with master weights as close to learner_ranks = 1 as
    rank_weights.py allows."""
    assert_weights_agree(final_weights(1), final_weights(2))


def test_two_learner_ranks_train_the_adapters_of_one(final_weights):
    """A LoRA run (rank 4) on two replicated ranks: every follower builds the same adapters
    and takes rank 0's, the gradients summed are the adapters' only; its checkpoint (adapters)
    and their optimizer state end as one rank's, within rank_weights.py's tolerance."""
    one, two = final_weights(1, lora=4), final_weights(2, lora=4)
    assert one and all(k.endswith((".lora_A", ".lora_B")) for k in one)
    assert_weights_agree(one, two)
    assert_weights_agree(final_weights(1, lora=4, file="optimizer.safetensors"),
                         final_weights(2, lora=4, file="optimizer.safetensors"))


def test_a_ray_placed_rank_gives_the_local_ranks_weights(final_weights, ray_session):
    """learner_placement = 'ray' (rank 1 a Ray actor joined over a TCP store, one CPU: one
    torch thread, as the local follower on 2 cores) ends with master weights torch.equal to
    local placement's: where a rank runs changes nothing in what it computes."""
    local, placed = final_weights(2), final_weights(2, "ray")
    assert local.keys() == placed.keys()
    assert all(torch.equal(local[k], placed[k]) for k in local)


def test_a_dying_ray_placed_rank_ends_the_run(tmp_path, ray_session):
    """The Ray actor of rank 1 killed (SIGKILL) after the first checkpoint: the run ends with
    TrainingAborted naming rank 1 and its actor, and the intact checkpoint, which loads."""
    run_dir = tmp_path / "dies"

    def kill_rank_after_first_checkpoint() -> None:
        while latest(run_dir) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = [int(pid) for pid in os.listdir("/proc") if pid.isdigit()
                 and b"RankWorker" in _cmdline(pid)]
        if ranks:
            os.kill(ranks[0], signal.SIGKILL)

    deadline = time.monotonic() + 300
    killer = threading.Thread(target=kill_rank_after_first_checkpoint, daemon=True)
    killer.start()
    with pytest.raises(TrainingAborted) as aborted:
        train("tiny", {**OVERRIDES, "train.steps": 20, "train.checkpoint_every": 1,
                       "run.output_dir": str(tmp_path), "run.name": "dies",
                       "dist.learner_ranks": 2, "dist.learner_placement": "ray"})
    message = str(aborted.value)
    assert "learner rank 1 (its Ray actor failed" in message, message
    assert "The last checkpoint is intact" in message
    assert load_file(latest(run_dir) / "model.safetensors")


def test_fsdp_ranks_give_the_replicated_update(final_weights):
    """learner_strategy = 'fsdp' (weights, gradients and AdamW state sharded over 2 ranks),
    with 2 epochs per step (the second replays on rank 0's gathered weights), ends with master
    weights within FSDP_TOLERANCE of replicated ranks and as close to one rank as
    rank_weights.py allows; its checkpoint's optimizer state (gathered from the shards) has a
    one-rank run's layout, every tensor within FSDP_TOLERANCE of the replicated run's."""
    replicated, sharded = final_weights(2, epochs=2), final_weights(2, strategy="fsdp", epochs=2)
    assert replicated.keys() == sharded.keys()
    assert max(float((replicated[k] - sharded[k]).abs().max()) for k in sharded) <= FSDP_TOLERANCE
    one = final_weights(1, epochs=2)
    assert_weights_agree(one, sharded)
    optimizer = {(ranks, strategy): final_weights(ranks, strategy=strategy, epochs=2,
                                                  file="optimizer.safetensors")
                 for ranks, strategy in ((1, "replicate"), (2, "replicate"), (2, "fsdp"))}
    opt_one, opt_rep, opt_fsdp = optimizer.values()
    assert opt_rep.keys() == opt_fsdp.keys() == opt_one.keys()
    assert max(float((opt_rep[k] - opt_fsdp[k]).abs().max()) for k in opt_rep) <= FSDP_TOLERANCE


def test_an_fsdp_run_resumes_exactly(final_weights, tmp_path):
    """An FSDP run stopped after 2 steps and resumed for the 3rd (the shards rebuilt from the
    checkpoint's whole weights and optimizer state) ends torch.equal to the uninterrupted run,
    weights and optimizer state."""
    overrides = {**OVERRIDES, "run.output_dir": str(tmp_path), "run.name": "resumed",
                 "algo.epochs": 2, "dist.learner_ranks": 2, "dist.learner_strategy": "fsdp"}
    train("tiny", {**overrides, "train.steps": 2})
    train("tiny", overrides)
    for file in ("model.safetensors", "optimizer.safetensors"):
        whole = final_weights(2, strategy="fsdp", epochs=2, file=file)
        resumed = load_file(latest(tmp_path / "resumed") / file)
        assert whole.keys() == resumed.keys()
        assert all(torch.equal(whole[k], resumed[k]) for k in whole), file


def test_a_nonfinite_loss_on_one_fsdp_rank_drops_the_step_everywhere(tmp_path):
    """Rank 0's loss made NaN (the follower's stays finite): rank 0 still runs every backward
    (FSDP's collectives need it: stopping early leaves the follower waiting in a collective,
    which no signal interrupts, hence the run in a subprocess with a timeout), every update is
    counted non-finite and dropped on every rank: the weights gathered from all shards after
    every step equal those after the first (no update had a signal before step 2) bit for bit."""
    overrides = {**OVERRIDES, "run.output_dir": str(tmp_path), "run.name": "nan",
                 "train.max_bad_steps": 3, "train.checkpoint_every": 1,
                 "train.keep_checkpoints": 3, "dist.learner_ranks": 2,
                 "dist.learner_strategy": "fsdp"}
    script = f"""
import functools
from qarl.algo import LOSSES
from qarl.train import train

real = LOSSES["tbpo"]

@functools.wraps(real)  # the same parameters, for the registry's checks
def nan_loss(*args, **kwargs):
    loss, metrics = real(*args, **kwargs)
    return loss * float("nan"), metrics

LOSSES["tbpo"] = nan_loss  # in this process only: rank 0
train("tiny", {overrides!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    run_dir = tmp_path / "nan"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    updates = [m for m in steps if m.get("guard/no_signal") == 0.0]
    assert updates and all(m["guard/nonfinite"] == 1.0 for m in updates), steps
    first, *later = [load_file(run_dir / f"step_00000{n}" / "model.safetensors") for n in (1, 2, 3)]
    assert all(torch.equal(first[k], w[k]) for w in later for k in first)


def _raises(rank: int, world: int, init) -> int:
    raise ValueError(f"rank {rank} cannot build its learner")


def test_ray_placed_ranks_that_cannot_start_or_fail_are_named(ray_session):
    """A Ray-placed rank that needs more CPUs than the cluster has is never ready: the join
    wait ends after its timeout naming the rank and `ray status`; a rank whose body raises is
    reported with the error's text as its exit reason."""
    from qarl.parallel import RayRanks
    from qarl.parallel.launch import wait_for_followers
    from qarl.parallel.ranks import LearnerRankDied

    unplaceable = RayRanks(_raises, 2, cpus_per_rank=64)
    try:
        late = r"learner ranks \[1\] did not start within 2 s.*ray status"
        with pytest.raises(LearnerRankDied, match=late):
            wait_for_followers(unplaceable.members, timeout_s=2)
    finally:
        unplaceable.close(timeout_s=0)
    failing = RayRanks(_raises, 2)
    try:
        wait_for_followers(failing.members, timeout_s=120)
        failing.start(("127.0.0.1", 1))
        deadline = time.monotonic() + 60
        while (reason := failing.members[0].exit_reason()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reason == "it raised ValueError: rank 1 cannot build its learner", reason
    finally:
        failing.close(timeout_s=0)


@pytest.mark.slow
def test_a_dying_rank_ends_the_run_with_the_checkpoint_intact(tmp_path):
    """A follower rank killed after the first checkpoint ends the run (nonzero exit) with a
    message naming the dead rank and the intact checkpoint, which still loads."""
    script = ("from qarl.train import train\n"
              f"train('tiny', {{'run.output_dir': {str(tmp_path)!r}, 'run.name': 'dies', "
              "'train.steps': 20, 'train.checkpoint_every': 1, 'rollout.batch_size': 16, "
              "'train.micro_batch_size': 4, 'eval.size': 4, 'eval.full_precision': False, "
              "'dist.learner_ranks': 2})\n")
    log = tmp_path / "stderr.txt"
    run = subprocess.Popen([sys.executable, "-c", script], stderr=log.open("w"))
    run_dir = tmp_path / "dies"
    while latest(run_dir) is None and run.poll() is None:
        time.sleep(0.5)
    followers = [int(pid) for pid in os.listdir("/proc") if pid.isdigit()
                 and b"qarl.train.learner.follow" in _cmdline(pid)]
    assert followers, "no follower rank process found"
    os.kill(followers[0], signal.SIGKILL)
    assert run.wait(timeout=600) != 0
    stderr = log.read_text()
    assert "learner rank 1 (exit code -9) of 2 died" in stderr, stderr[-2000:]
    assert "The last checkpoint is intact" in stderr
    saved = latest(run_dir)
    assert load_file(saved / "model.safetensors")


@pytest.mark.slow
def test_a_ray_placed_rank_ends_with_a_killed_trainer(tmp_path):
    """The trainer (rank 0, which started a local Ray) SIGKILLed mid-run: its Ray-placed rank
    1 is gone within 30 s (Ray ends the actors of a dead owner); nothing waits in a collective."""
    pytest.importorskip("ray")
    script = ("from qarl.train import train\n"
              f"train('tiny', {{'run.output_dir': {str(tmp_path)!r}, 'run.name': 'owner', "
              "'train.steps': 200, 'rollout.batch_size': 16, 'train.micro_batch_size': 4, "
              "'eval.size': 4, 'eval.full_precision': False, 'dist.learner_ranks': 2, "
              "'dist.learner_placement': 'ray'})\n")
    run = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL,
                           start_new_session=True)  # its group: Ray's own helpers, cleaned below
    deadline = time.monotonic() + 300
    while not _rank_actors() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _rank_actors(), "no Ray-placed rank process found"
    time.sleep(2)  # into the steps
    run.kill()
    run.wait()
    deadline = time.monotonic() + 30
    while _rank_actors() and time.monotonic() < deadline:
        time.sleep(0.5)
    alive = _rank_actors()
    with contextlib.suppress(ProcessLookupError):  # Ray's agents outlive a SIGKILLed driver
        os.killpg(run.pid, signal.SIGKILL)
    assert not alive, "a Ray-placed rank outlived its trainer by 30 s"


def _rank_actors() -> list[str]:
    return [pid for pid in os.listdir("/proc") if pid.isdigit() and b"RankWorker" in _cmdline(pid)]


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
