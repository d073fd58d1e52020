"""The run itself: where it lives, how it starts, where its metrics go."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from qarl.config.section import SECTION as _SECTION


class RunSection(BaseModel):
    """Where the run lives and how it starts. The run folder is `output_dir/name`."""

    model_config = _SECTION

    name: str | None = Field(None, min_length=1, description="Run name and folder name under "
        "output_dir. Default: the recipe file's stem (recipes/default.toml -> 'default'). "
        "Letters, digits, '.', '_' and '-' only.")
    output_dir: str = Field("runs", min_length=1, description="Folder that holds run folders.")
    seed: int = Field(0, ge=0, description="Seed for sampling, data order and initialization.")
    resume: bool = Field(
        True,
        description="Resume from the last checkpoint in the run folder if there is one (the "
        "recipe must be the one it was saved with, save for train.steps, micro-batch, device, "
        "checkpoint and log settings); false starts from step 0 and clears the folder's "
        "checkpoints and metrics. `qarl train --resume RUN_DIR` resumes with the saved recipe.",
    )


class LogSection(BaseModel):
    """Where metrics go. A metrics.jsonl line per step is what plots and reports read."""

    model_config = _SECTION

    progress: bool = Field(True, description="Show a progress bar with the main metrics.")
    tensorboard: Literal["auto"] | bool = Field(
        "auto",
        description="Write TensorBoard events: 'auto' = only if tensorboard is installed; "
        "true = required (an error if it is not installed).",
    )
    plot: bool = Field(
        True, description="Write curves.png, plots of the metrics, at the end of the run (read "
        "from metrics.jsonl, so only with jsonl = true)."
    )
    jsonl: bool = Field(True, description="Write metrics.jsonl in the run folder.")
    wandb: bool = Field(
        False, description="Also send every metrics row to Weights & Biases (`pip install "
        "'qarl[wandb]'`): one wandb run per qarl run, named run.name, with the resolved recipe "
        "as its config and each curve named by qarl's metric key (e.g. 'reward/mean', "
        "'eval/accuracy_quantized') at qarl's step. wandb's own variables apply: WANDB_MODE="
        "offline writes only local files, WANDB_DIR places them (default: the run folder), "
        "WANDB_ENTITY names the team.")
    wandb_project: str = Field("qarl", min_length=1,
                               description="The Weights & Biases project of log.wandb's runs.")
