"""[dist] learner ranks on `tiny`: two gloo ranks make the update of one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qarl.train import train
from qarl.train.checkpoint import latest

# Measured (docs/distributed.md): max |w_2 - w_1| = 3.3e-6 over every master weight after
# these 3 steps (same rollouts, same rewards). The runs differ only in the order of the
# gradient sums (~1e-7 relative), but Adam divides each coordinate by its own gradient
# scale, so a coordinate whose gradient is at rounding-noise level moves by a visible
# fraction of lr (3e-4) either way (micro-batching alone moves weights by 5.1e-6 in one step:
# tests/integration/test_train_tiny.py). 2e-5 = lr / 15, as there.
TOLERANCE = 2e-5


def _final_weights(tmp_path, ranks: int) -> dict[str, torch.Tensor]:
    overrides = {"run.output_dir": str(tmp_path), "run.name": f"ranks{ranks}",
                 "train.steps": 3, "rollout.batch_size": 16, "train.micro_batch_size": 4,
                 "eval.size": 4, "eval.full_precision": False, "dist.learner_ranks": ranks}
    train("tiny", overrides)
    return load_file(latest(tmp_path / f"ranks{ranks}") / "model.safetensors")


def test_two_learner_ranks_give_the_weights_of_one(tmp_path):
    """tiny, 3 steps, 4 micro-batches per step: learner_ranks = 2 (each rank 2 micro-batches,
    gradients all-reduced) ends with master weights within TOLERANCE of learner_ranks = 1,
    and not bit-identical to the starting point (the steps did update)."""
    one, two = _final_weights(tmp_path, 1), _final_weights(tmp_path, 2)
    assert one.keys() == two.keys()
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert worst <= TOLERANCE, worst


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
                 and b"qarl.train.ranks" in _cmdline(pid)]
    assert followers, "no follower rank process found"
    os.kill(followers[0], signal.SIGKILL)
    assert run.wait(timeout=600) != 0
    stderr = log.read_text()
    assert "learner rank 1 (exit code -9) of 2 died" in stderr, stderr[-2000:]
    assert "The last checkpoint is intact" in stderr
    saved = latest(run_dir)
    assert load_file(saved / "model.safetensors")


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
