"""Where step metrics go: a JSONL file (always), TensorBoard (when installed), Weights & Biases
(log.wandb), a progress bar."""

from __future__ import annotations

import importlib.util
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from qarl import jsonio


# Figures shown on the progress bar: metric key -> short label.
PROGRESS_FIGURES = {
    "reward/mean": "reward",
    "reward/accuracy": "acc",
    "mismatch/abs_diff_max": "|dlogp|max",
    "errors/rep_ngram": "rep",
    "speed/tokens_per_s": "tok/s",
}


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


class MetricsLogger:
    """Appends one row per log() call; `start_step` places the progress bar of a resumed run
    (the trainer restores the file itself: qarl.train.checkpoint.restore_metrics)."""

    def __init__(self, run_dir: Path, total_steps: int, progress: bool = True,
                 tensorboard: bool | str = "auto", jsonl: bool = True, start_step: int = 0,
                 wandb_run: Any = None):
        self.run_dir = Path(run_dir)
        self.wandb_run = wandb_run  # a started wandb run (`start_wandb`), or None
        self.path = self.run_dir / "metrics.jsonl"
        self.jsonl = jsonl
        self.writer = None
        want_tb = tensorboard is True or (
            tensorboard == "auto" and importlib.util.find_spec("tensorboard") is not None
        )
        if want_tb:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            file=sys.stderr, dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        row = {"step": step, "kind": kind, **{k: _plain(v) for k, v in metrics.items()}}
        if self.jsonl:
            with self.path.open("a") as f:
                f.write(jsonio.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(f"{kind}/{key}", value, step)
        if self.wandb_run is not None:  # train and eval rows' keys are distinct already
            self.wandb_run.log({k: v for k, v in row.items() if k != "step"
                                and isinstance(v, (int, float)) and not isinstance(v, bool)},
                               step=step)
        if self.bar is not None and kind == "train":
            shown = {label: f"{row[k]:.3g}" for k, label in PROGRESS_FIGURES.items()
                     if isinstance(row.get(k), (int, float))}
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


WANDB_ID = "wandb_id.txt"  # the run folder's wandb run id: a resumed run logs to the same run


def start_wandb(run_dir: Path, name: str, project: str, recipe: dict[str, Any]) -> Any:
    """A wandb run for the qarl run in `run_dir` (its id kept there, so a resumed qarl run
    resumes it), with the resolved recipe as its config; its files go under $WANDB_DIR, else
    the run folder."""
    import wandb

    id_file = Path(run_dir) / WANDB_ID
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    id_file.write_text(run_id + "\n")
    return wandb.init(project=project, name=name, id=run_id, resume="allow", config=recipe,
                      dir=os.environ.get("WANDB_DIR") or str(run_dir))
