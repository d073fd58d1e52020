"""What stops a run, and what it says when it does.

- `BadStepGuard`: a step whose loss, gradient or optimizer settings (learning rate, weight
  decay, betas: `settings_finite`) were not finite is skipped by the update
  (`learner.update.optimizer_step`: weights and optimizer state untouched, `guard/nonfinite` = 1);
  `train.max_bad_steps` such steps in a row abort the run with `TrainingAborted`.
- `check_weights`: after every optimizer step, every weight is finite, or the run stops
  (`NonFiniteWeights`) before those weights reach the engine or a checkpoint. With finite
  gradients and settings AdamW and Muon cannot make a weight non-finite (Adam's step is
  bounded by lr times a constant, Muon's is orthogonalized), so this catches what no input
  check can: a bug or a hardware fault. Undoing such a step would take a copy of every
  weight and moment before each step (three fp32 copies of the model); stopping at the last
  checkpoint, intact, takes none.
- Out of memory: `out_of_memory_message` names the settings to lower.
- A stop signal: `RunStopped`, raised after the checkpoint of the finished steps is saved.
Whatever stops a run, its last checkpoint is complete (qarl.train.checkpoint).
"""

from __future__ import annotations

import math
import signal
from pathlib import Path

import torch

from qarl.config import RunConfig


class TrainingAborted(RuntimeError):
    """The run cannot go on; the message says why and what to change."""


class RunStopped(Exception):
    """SIGTERM / SIGINT stopped the run after saving `checkpoint` (None: stopped in the warm
    start, before there was anything to save); exit with `exit_code`."""

    def __init__(self, signum: int, checkpoint: Path | None, run_dir: Path):
        self.signum, self.checkpoint = signum, checkpoint
        self.exit_code = 128 + signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT
        name = signal.Signals(signum).name
        super().__init__(
            f"{name}: stopped; {checkpoint} holds the finished steps; continue with: qarl "
            f"train --resume {run_dir}" if checkpoint is not None else
            f"{name}: stopped before the first RL step (in the warm-start SFT); nothing was "
            f"saved: run the same command again, or qarl train --resume {run_dir}, to start")


class NonFiniteWeights(TrainingAborted):
    """An optimizer step left weights non-finite although its inputs were finite."""


def settings_finite(optimizers: list[torch.optim.Optimizer]) -> bool:
    """Every number in every optimizer's param groups (lr, weight decay, betas, eps) is finite."""
    values = [v for opt in optimizers for group in opt.param_groups for k, v in group.items()
              if k != "params"]
    numbers = [x for v in values for x in (v if isinstance(v, tuple | list) else (v,))
               if isinstance(x, float | int) and not isinstance(x, bool)]
    return all(math.isfinite(x) for x in numbers)


def check_weights(named: list[tuple[str, torch.Tensor]]) -> None:
    """Raise NonFiniteWeights naming the tensors of `named` ((name, weight) pairs; on FSDP
    ranks the local shards) that hold a NaN or an infinity. One fused L2-norm pass over them
    (benchmarks/step_time.py times it within the update); a tensor whose norm is not finite is
    then checked element by element, so huge but finite weights are not mistaken for non-finite
    ones."""
    if not named:
        return
    norms = torch._foreach_norm([t.detach() for _, t in named])
    suspects = [i for i, norm in enumerate(norms) if not math.isfinite(float(norm))]
    names = [named[i][0] for i in suspects if not bool(torch.isfinite(named[i][1]).all())]
    if names:
        raise NonFiniteWeights(
            f"the optimizer step left {len(names)} weight tensors non-finite (e.g. {names[:3]}) "
            "although its loss, gradients and settings were finite: a bug or a hardware fault "
            "(please report it). Those weights were neither saved nor sent to the engine")


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
