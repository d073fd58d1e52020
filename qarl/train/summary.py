"""The end of a run: the curves PNG and a before/after summary table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qarl.config import LogSection
from qarl.report import read_metrics

# Rows of the final table: metric key stem -> label.
TABLE_ROWS = {
    "accuracy": "held-out accuracy",
    "mean": "held-out mean reward",
    "rep_ngram": "repeated 4-grams",
    "truncated": "truncated responses",
}


def _first_eval(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.exists() else []
    evals = [r for r in rows if r.get("kind") == "eval" and r["step"] == 0]
    return evals[-1] if evals else None


def _cell(value) -> str:
    """A table cell: 3 decimals, '-' for missing or undefined (e.g. no response had 4 tokens)."""
    if isinstance(value, (int, float)) and value == value:
        return f"{value:8.3f}"
    return f"{'-':>8s}"


def format_table(before: dict | None, after: dict) -> str:
    policies = [k[len("eval/accuracy_"):] for k in after if k.startswith("eval/accuracy_")]
    lines = [f"{'metric':28s} {'policy':15s} {'before':>8s} {'after':>8s}"]
    for stem, label in TABLE_ROWS.items():
        for policy in policies:
            key = f"eval/{stem}_{policy}"
            if key not in after:
                continue
            b = before.get(key) if before else None
            lines.append(f"{label:28s} {policy:15s} {_cell(b)} {_cell(after[key])}")
    return "\n".join(lines)


def finish_run(run_dir: Path, log: LogSection, before: dict | None, after: dict) -> dict[str, Any]:
    """The run's summary: its folder, the eval metrics before and after training (`before`
    read back from metrics.jsonl for a resumed run), the curves PNG, the printed table."""
    before = before or _first_eval(run_dir)
    plot = None
    if log.plot and log.jsonl:
        from qarl.report.plots import plot_run

        plot = str(plot_run(run_dir / "metrics.jsonl", run_dir / "curves.png"))
    return {
        "run_dir": str(run_dir),
        "before": before,
        "after": after,
        "plot": plot,
        "table": format_table(before, after),
    }
