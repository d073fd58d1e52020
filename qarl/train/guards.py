"""What stops a run, and what it says when it does.

- `BadStepGuard`: a step whose loss or gradient was not finite is skipped by the update
  (`phases.optimizer_step`: weights and optimizer state untouched, `guard/nonfinite` = 1);
  `train.max_bad_steps` such steps in a row abort the run with `TrainingAborted`.
- Out of memory: `out_of_memory_message` names the settings to lower.
- A stop signal: `RunStopped`, raised after the checkpoint of the finished steps is saved.
Whatever stops a run, its last checkpoint is complete (qarl.train.checkpoint).
"""

from __future__ import annotations

import signal
from pathlib import Path

from qarl.config import RunConfig


class TrainingAborted(RuntimeError):
    """The run cannot go on; the message says why and what to change."""


class RunStopped(Exception):
    """SIGTERM / SIGINT stopped the run after saving `checkpoint`; exit with `exit_code`."""

    def __init__(self, signum: int, checkpoint: Path, run_dir: Path):
        self.signum, self.checkpoint = signum, checkpoint
        self.exit_code = 128 + signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT
        super().__init__(
            f"{signal.Signals(signum).name}: stopped; {checkpoint} holds the finished steps; "
            f"continue with: qarl train --resume {run_dir}"
        )


class BadStepGuard:
    """Counts steps in a row whose update was skipped for a non-finite loss or gradient."""

    def __init__(self, limit: int, in_a_row: int = 0):
        self.limit, self.in_a_row = limit, in_a_row

    def update(self, step: int, metrics: dict[str, float], last_checkpoint: Path | None) -> None:
        """Count step `step` (1-based); raise TrainingAborted at `limit` bad steps in a row."""
        self.in_a_row = self.in_a_row + 1 if metrics.get("guard/nonfinite") else 0
        if self.in_a_row >= self.limit:
            raise TrainingAborted(
                f"{self.in_a_row} steps in a row (steps {step - self.in_a_row + 1}-{step}) had a "
                f"non-finite loss or gradient, so their updates were skipped "
                f"(train.max_bad_steps = {self.limit}). Check: train.lr (too high makes the "
                "weights blow up), the loss parameters (algo.loss_params), the rewards "
                "(reward/mean in metrics.jsonl), and model.master_dtype (float32 is safer than "
                f"bfloat16). Last checkpoint (intact): {last_checkpoint or 'none yet'}."
            )


def is_out_of_memory(err: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), or a RuntimeError saying it (CPU allocators)."""
    return isinstance(err, RuntimeError) and (
        type(err).__name__ == "OutOfMemoryError" or "out of memory" in str(err).lower())


def out_of_memory_message(err: BaseException, config: RunConfig, step: int, run_dir: Path,
                          last_checkpoint: Path | None) -> str:
    """What ran out (the error's first line), the settings to lower and how to continue."""
    seen = (str(err).splitlines() or [type(err).__name__])[0]
    rollout, train = config.rollout, config.train
    return (
        f"out of memory in step {step + 1} of {train.steps} ({seen}). Lower "
        f"train.micro_batch_size (now {train.micro_batch_size}: the update's activations), "
        f"rollout.batch_size (now {rollout.batch_size}) or rollout.max_new_tokens (now "
        f"{rollout.max_new_tokens}): generation's KV cache grows with both. The last "
        f"checkpoint is intact ({last_checkpoint or 'none yet'}): a smaller "
        f"train.micro_batch_size continues it with qarl train --resume {run_dir} "
        "--train.micro_batch_size=N; the other two change the algorithm, so start a new run."
    )
