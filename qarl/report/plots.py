"""Curves of a run, drawn from its metrics.jsonl only (so any past run can be re-plotted)."""

from __future__ import annotations

from pathlib import Path

from qarl.report.metrics_file import read_metrics

# Panel title -> metric keys drawn in it (missing keys are skipped).
PANELS = {
    "reward": ["reward/mean", "reward/accuracy"],
    "held-out accuracy": ["eval/accuracy_quantized", "eval/accuracy_full_precision"],
    "mismatch |old - rollout| logp": ["mismatch/abs_diff_mean", "mismatch/abs_diff_max"],
    "error tokens": ["errors/rep_ngram", "errors/rep_run", "errors/truncated",
                     "errors/lowprob_tokens", "errors/garbled"],
    "policy": ["policy/entropy", "loss/clip_frac", "loss/band_drop_frac"],
    "seconds per phase": ["time/generate", "time/reward", "time/old_logp", "time/update",
                          "time/sync"],
}


def plot_run(metrics_path: Path, out_path: Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (panel, keys) in zip(axes.flat, PANELS.items()):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows
                      if isinstance(r.get(key), (int, float))]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(xs) < 12 else None, markersize=3,
                        label=key.split("/", 1)[1])
        ax.set_title(panel)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
        if panel.startswith("mismatch") and any(
            (line.get_ydata() > 0).any() for line in ax.lines
        ):
            ax.set_yscale("symlog", linthresh=1e-8)
    fig.suptitle(title or Path(metrics_path).parent.name)
    fig.tight_layout()
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return Path(out_path)
