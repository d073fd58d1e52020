"""The comparison's figures, drawn from the numbers of `qarl.report.compare` (no file reading).

accuracy.png: held-out accuracy (deployed policy, solid; full-precision master, dashed) and
training reward per step, one colour per arm, the band spanning min to max over seeds.
mismatch.png: mean / max |Δlogp| and k3-KL per step. errors.png: error-token rates per step.
time.png: mean seconds per training step, stacked by phase, one bar per arm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qarl.report.compare import DEPLOYED_KEY, PHASES, Runs, curve

MISMATCH = {"mean |Δlogp|": "mismatch/abs_diff_mean", "max |Δlogp|": "mismatch/abs_diff_max",
            "k3-KL": "mismatch/k3_kl"}
ERRORS = {"repeated n-grams": "errors/rep_ngram", "truncated": "errors/truncated",
          "low-probability tokens": "errors/lowprob_tokens", "garbled": "errors/garbled"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(ax, seeds, key: str, kind: str, colour, label: str | None, style: str = "-") -> bool:
    """One arm's curve with its min-max band; False when no seed has the metric."""
    line = curve(seeds, key, kind)
    if not line.steps:
        return False
    marker = "o" if len(line.steps) < 12 else None
    ax.plot(line.steps, line.mean, style, color=colour, label=label, marker=marker, markersize=3)
    if len(seeds) > 1:
        ax.fill_between(line.steps, line.low, line.high, color=colour, alpha=0.15, linewidth=0)
    return True


def _panels(runs: Runs, panels: dict[str, list[tuple[str, str, str]]], path: Path,
            title: str) -> Path | None:
    """One subplot per panel; each holds (key, kind, line style) curves of every arm."""
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = False
    for ax, (panel, lines) in zip(axes.flat, panels.items()):
        for index, (arm, seeds) in enumerate(runs.items()):
            colour = colours[index % len(colours)]
            for number, (key, kind, style) in enumerate(lines):
                drawn |= _draw(ax, seeds, key, kind, colour, arm if number == 0 else None, style)
        ax.set_title(panel)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    if drawn:
        fig.savefig(path, dpi=90)
    plt.close(fig)
    return path if drawn else None


def plot_time(table: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Stacked bar: mean seconds per step of each phase, per arm."""
    arms = [arm for arm, entry in table.items() if entry["figures"]["time_step"].mean is not None]
    if not arms:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(arms) + 2), 4))
    bottom = [0.0] * len(arms)
    for phase in PHASES:
        heights = [table[arm]["figures"][f"time_{phase}"].mean or 0.0 for arm in arms]
        ax.bar(arms, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("seconds per training step")
    ax.set_title("mean over steps and seeds, by phase")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_comparison(runs: Runs, table: dict[str, dict[str, Any]], folder: Path) -> list[Path]:
    """Write the four figures into `folder`; return those drawn (a figure with no data is
    skipped, e.g. mismatch when no arm logged it)."""
    folder = Path(folder)
    drawn = [
        _panels(runs, {
            "held-out accuracy (solid: deployed, dashed: full-precision master)": [
                (DEPLOYED_KEY, "eval", "-"),
                ("eval/accuracy_full_precision", "eval", "--")],
            "training reward": [("reward/mean", "train", "-")],
        }, folder / "accuracy.png", "accuracy per step (band: min-max over seeds)"),
        _panels(runs, {name: [(key, "train", "-")] for name, key in MISMATCH.items()},
                folder / "mismatch.png", "learner-vs-sampler mismatch per training step"),
        _panels(runs, {name: [(key, "train", "-")] for name, key in ERRORS.items()
                       if any(curve(seeds, key).steps for seeds in runs.values())},
                folder / "errors.png", "error-token rates of training rollouts"),
        plot_time(table, folder / "time.png"),
    ]
    return [path for path in drawn if path is not None]
