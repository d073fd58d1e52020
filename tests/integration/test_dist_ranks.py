"""[dist] learner ranks on `tiny`: two gloo ranks make the update of one."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from qarl.train import train
from qarl.train.checkpoint import latest

# Measured (docs/distributed.md): max |w_2 - w_1| over every master weight after 3 steps.
# The two runs differ only in the order of the gradient sums (float32 rounding, ~1e-7
# relative); Adam turns that into ~lr * 1e-6 per step.
TOLERANCE = 1e-6


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
