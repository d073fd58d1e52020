"""Resuming a run: which checkpoint, with which recipe, and what may change.

A resumed run continues the same run: its recipe must be the one its checkpoint was saved
with, except for RESUME_FREE keys, which do not change what a step computes (beyond the last
bits, for train.micro_batch_size, train.device and dist.learner_ranks; dist.rollout_workers
not at all)
or only say how long to train: `train.steps` (with a decaying lr_schedule, the lr of the
remaining steps follows the new length). Anything else is refused with the differences
listed: a run half with one recipe and half with another is not the run either recipe
describes.

`qarl train --resume RUN_DIR` (`resume_config`) reads RUN_DIR/config.toml, the resolved recipe
the run started with; `qarl train RECIPE` with run.resume = true (the default) resumes too,
when the run folder holds a checkpoint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from qarl.config import RESOLVED_NAME, ConfigError, Problem, RunConfig, load_config, parse_overrides
from qarl.errors import UserError
from qarl.train import checkpoint

RESUME_FREE = ("train.steps", "train.micro_batch_size", "train.device",
               "train.gradient_checkpointing",
               "train.checkpoint_every", "train.keep_checkpoints", "train.final_checkpoint",
               "train.max_bad_steps",
               "train.audit_fraction",
               "train.audit_full_every", "run.output_dir", "run.name", "run.resume", "log.",
               "dist.", "monitor.", "quant.contract_exempt", "quant.sync_check",
               "quant.sync_delta", "quant.over_budget", "quant.budget_factor",
               "task.reward_error_warn")


def _free(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_FREE)


def _flat(config: RunConfig) -> dict[str, Any]:
    """{"section.key": value} of every key; an optional section left out of the recipe (e.g.
    [compare]: None) is the single key "section" (a recipe without it resumes)."""
    flat: dict[str, Any] = {}
    for section, values in config.model_dump().items():
        if isinstance(values, dict):
            flat.update({f"{section}.{key}": value for key, value in values.items()})
        else:
            flat[section] = values
    return flat


def check_resumable(saved: RunConfig, config: RunConfig, folder: Path) -> None:
    """Raise ConfigError listing every key (other than RESUME_FREE) where `config` differs
    from `saved`, the config of checkpoint `folder`."""
    old, new = _flat(saved), _flat(config)
    problems = [
        Problem(key, f"is {new.get(key)!r} but the run's checkpoint {folder} was saved with "
                     f"{old.get(key)!r}")
        for key in sorted(old.keys() | new.keys()) if not _free(key) and old.get(key) != new.get(key)
    ]
    if problems:
        problems.append(Problem("", "a resumed run keeps its recipe (it may change only "
                                    f"{', '.join(RESUME_FREE)}*): undo these changes, start over "
                                    "with --run.resume=false, or give the new recipe its own "
                                    "--run.name"))
        raise ConfigError(problems, f"resuming {folder.parent}")


@dataclass
class ResumePoint:
    """Where a run starts: `checkpoint` (None: step 0) and the checkpoint folders of the run
    that cannot be resumed, with why (`damaged`), which the run sets aside when it starts."""

    run_dir: Path
    checkpoint: Path | None
    damaged: dict[Path, str] = field(default_factory=dict)
    start_over: bool = False  # run.resume = false: the folder's checkpoints and metrics go

    def describe(self) -> str:
        return "; ".join(f"{f.name} ({why})" for f, why in sorted(self.damaged.items()))


def resume_point(config: RunConfig) -> ResumePoint:
    """Where this run starts (its checkpoint checked against its recipe). With run.resume =
    true: the newest whole checkpoint, passing over (and naming) damaged ones; a folder whose
    checkpoints are all damaged is refused (UserError), never started over. With run.resume =
    false: step 0, and the run folder's checkpoints and metrics are cleared."""
    run_dir = Path(config.run.output_dir) / config.run.name
    if not config.run.resume:
        return ResumePoint(run_dir, None, start_over=True)
    found, damaged = checkpoint.find(run_dir)
    point = ResumePoint(run_dir, found, damaged)
    if found is None and damaged:
        raise UserError(
            f"{run_dir} holds checkpoints, but none can be resumed: {point.describe()}. Nothing "
            "was changed. Repair or move them away to resume from another copy, or start over "
            "with --run.resume=false (which deletes this folder's checkpoints and metrics)")
    if found is not None:
        check_resumable(load_config(found / "config.toml"), config, found)
        _check_extendable(found, config)
    if damaged:
        print(f"resuming from {found}: passed over {point.describe()}; they are set aside as "
              f"damaged_<name> in {run_dir}", file=sys.stderr)
    return point


def _check_extendable(found: Path, config: RunConfig) -> None:
    """Refuse (UserError) to take steps from a weights-only checkpoint (a finished run's,
    train.final_checkpoint = 'weights'): it holds no optimizer state to step with. Resuming
    it at its own step (the run's end: only the final evaluation runs again) is fine."""
    step = checkpoint.step_of(found)
    if checkpoint.has_optimizer_state(found) or config.train.steps <= step:
        return
    raise UserError(
        f"{found} is the final checkpoint of a run that ended at step {step}, saved without "
        "optimizer state (train.final_checkpoint = 'weights'), so the run cannot go on to "
        f"train.steps = {config.train.steps}. Nothing was changed. Its weights can still be "
        "evaluated and exported (qarl eval --checkpoint, qarl export); to train on, export "
        "it (qarl export RUN_DIR OUT --format hf) and start a new run on it (--model.name=OUT, "
        "its own --run.name). Keep train.final_checkpoint = 'full' for runs you mean to extend")


def resume_config(run_dir: str | Path, overrides: Mapping[str, Any] | Sequence[str] | None = None
                  ) -> RunConfig:
    """The config that continues the run in `run_dir`: its saved resolved recipe, placed in
    the folder where it now is, with `overrides` limited to RESUME_FREE keys."""
    run_dir = Path(run_dir)
    path = run_dir / RESOLVED_NAME
    if not path.is_file():
        raise ConfigError([Problem("", f"{run_dir} holds no {RESOLVED_NAME}, so it is not a run "
                                       "folder; give the folder `qarl train` printed at the "
                                       "start of the run (OUTPUT_DIR/NAME)")], "--resume")
    if overrides is not None and not isinstance(overrides, Mapping):
        overrides = parse_overrides(list(overrides))
    overrides = dict(overrides or {})
    refused = [Problem(key, "cannot change when resuming: " + (
        "--resume names the run folder" if key.startswith("run.") else
        f"a resumed run keeps its recipe; only {', '.join(RESUME_FREE[:5])} and log.* may "
        "change (start a new run for anything else)"))
        for key in overrides if key.startswith("run.") or not _free(key)]
    if refused:
        raise ConfigError(refused, f"--resume {run_dir}")
    run_dir = run_dir.resolve()
    found, damaged = checkpoint.find(run_dir)
    if found is None and not damaged:  # stopped before its first checkpoint (in the warm start)
        print(f"--resume {run_dir}: no checkpoint yet (a run saves one every "
              "train.checkpoint_every steps and at its end): the run starts from step 1 with "
              "its saved recipe", file=sys.stderr)
    location = {"run.output_dir": str(run_dir.parent), "run.name": run_dir.name, "run.resume": True}
    return load_config(path, {**overrides, **location})
