"""The numbers of a comparison, from metrics rows alone: pure functions, no I/O.

Input everywhere: `runs[arm][seed]`, the rows of that run's metrics.jsonl (`read_metrics`).
Each figure of the table is first one number per run (`run_figures`: the final held-out
evaluation, or a mean / max over the run's training steps), then the mean ± sample std of
those numbers over the arm's seeds (`summarize`). qarl/report/README.md explains each one.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Rows = list[dict[str, Any]]
Runs = Mapping[str, Mapping[int, Rows]]  # arm -> seed -> metrics rows

# The step's phases (trainer PhaseTimer); a step's time is their sum.
PHASES = ("generate", "reward", "old_logp", "update", "sync")

# figure -> (reduction over one run, metrics key). "final" / "first": the value at the run's
# last / first evaluation; "mean" / "max" / "min": over its training steps (rows without the
# key skipped).
# A key "a|b" takes a, or b where a row has no a.
# The deployed policy is the quantized engine; a run without quantization (quant.scheme =
# "none") logs only `_full_precision` evaluations, and there that policy is the deployed one.
DEPLOYED = "accuracy_deployed"
DEPLOYED_KEY = "eval/accuracy_quantized|eval/accuracy_full_precision"
FIGURES: dict[str, tuple[str, str]] = {
    DEPLOYED: ("final", DEPLOYED_KEY),
    "accuracy_master": ("final", "eval/accuracy_full_precision"),
    f"{DEPLOYED}_first": ("first", DEPLOYED_KEY),  # before training, where evaluated at step 0
    "accuracy_master_first": ("first", "eval/accuracy_full_precision"),
    "reward": ("mean", "reward/mean"),
    "abs_diff_mean": ("mean", "mismatch/abs_diff_mean"),
    "abs_diff_max": ("max", "mismatch/abs_diff_max"),
    "k3_kl": ("mean", "mismatch/k3_kl"),
    "seq_ratio_mean": ("mean", "mismatch/seq_ratio_mean"),
    "seq_ratio_min": ("min", "mismatch/seq_ratio_min"),
    "seq_ratio_max": ("max", "mismatch/seq_ratio_max"),
    "clip_frac": ("mean", "loss/clip_frac"),
    "clip_frac_pos": ("mean", "loss/clip_frac_pos"),
    "clip_frac_neg": ("mean", "loss/clip_frac_neg"),
    "dual_clip_frac": ("mean", "loss/dual_clip_frac"),
    "band_drop": ("mean", "loss/band_drop_frac"),
    "rep_ngram": ("mean", "errors/rep_ngram"),
    "rep_run": ("mean", "errors/rep_run"),
    "truncated": ("mean", "errors/truncated"),
    "lowprob_tokens": ("mean", "errors/lowprob_tokens"),
    "garbled": ("mean", "errors/garbled"),
    "entropy": ("mean", "policy/entropy"),
    "changed_code_frac": ("mean", "sync/changed_code_frac"),  # deployed codes moved per push
    "over_budget": ("mean", "contract/over_budget"),  # fraction of steps over the budget
    "monitor_alerts": ("mean", "monitor/alert"),  # fraction of steps a monitor alerted at
    **{f"time_{phase}": ("mean", f"time/{phase}") for phase in PHASES},
    "time_step": ("mean", "time/step"),  # derived per row by `with_step_time`
}
REDUCE = {"mean": statistics.fmean, "max": max, "min": min}
NO_DENOMINATOR = 1e-9  # |reference - baseline| below this: gap closed is n/a


@dataclass(frozen=True)
class Stat:
    """One figure of one arm over its seeds: mean, sample std (None for one seed), values."""

    mean: float | None
    std: float | None
    values: list[float]  # one per seed that has the figure, in seed order


def number(value: Any) -> float | None:
    """A metrics value as a float; None for absent / null (NaN is written as null) / bools."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def value_of(row: dict[str, Any], key: str) -> float | None:
    """The row's number for `key`; "a|b" means the first of a, b that the row has."""
    for name in key.split("|"):
        value = number(row.get(name))
        if value is not None:
            return value
    return None


def with_step_time(row: dict[str, Any]) -> dict[str, Any]:
    """A training row with `time/step` = the sum of its phase times (if it has all of them)."""
    phases = [number(row.get(f"time/{phase}")) for phase in PHASES]
    if row.get("kind", "train") != "train" or any(value is None for value in phases):
        return row
    return {**row, "time/step": sum(phases)}


def train_rows(rows: Rows) -> Rows:
    return [with_step_time(row) for row in rows if row.get("kind", "train") == "train"]


def eval_rows(rows: Rows) -> Rows:
    return [row for row in rows if row.get("kind") == "eval"]


def run_figures(rows: Rows) -> dict[str, float | None]:
    """Every figure of FIGURES for one run; None where the run has no value for it."""
    train, evals = train_rows(rows), eval_rows(rows)
    at = {"first": min(evals, key=lambda row: row["step"]) if evals else {},
          "final": max(evals, key=lambda row: row["step"]) if evals else {}}
    figures: dict[str, float | None] = {}
    for name, (reduction, key) in FIGURES.items():
        if reduction in at:
            figures[name] = value_of(at[reduction], key)
            continue
        values = [v for v in (value_of(row, key) for row in train) if v is not None]
        figures[name] = REDUCE[reduction](values) if values else None
    return figures


def stat(values: Sequence[float | None]) -> Stat:
    """Mean and sample standard deviation (n - 1) of the values that are present."""
    present = [value for value in values if value is not None]
    if not present:
        return Stat(None, None, [])
    std = statistics.stdev(present) if len(present) > 1 else None
    return Stat(statistics.fmean(present), std, present)


def gap_closed(arm: float | None, reference: float | None, baseline: float | None) -> float | None:
    """Percent of the baseline's gap to the reference that the arm closes:
    100 * (arm - baseline) / (reference - baseline); None when a term is missing or the
    reference and baseline are equal (nothing to close)."""
    if arm is None or reference is None or baseline is None:
        return None
    if abs(reference - baseline) < NO_DENOMINATOR:
        return None
    return 100.0 * (arm - baseline) / (reference - baseline)


def relative_speed(arm_step_s: float | None, reference_step_s: float | None) -> float | None:
    """Steps per second of the arm over the reference's: reference s/step / arm s/step."""
    if arm_step_s is None or reference_step_s is None or arm_step_s <= 0:
        return None
    return reference_step_s / arm_step_s


def summarize(runs: Runs, reference: str | None = None,
              baseline: str | None = None) -> dict[str, dict[str, Any]]:
    """arm -> {"seeds", "figures": {figure: Stat}, "gap_closed_pct", "relative_speed"}.

    Gap closed uses the arms' mean deployed accuracy over seeds; relative speed
    the mean seconds per step. Both need the named reference (and baseline) arm in `runs`.
    """
    table: dict[str, dict[str, Any]] = {}
    for arm, seeds in runs.items():
        per_seed = [run_figures(seeds[seed]) for seed in sorted(seeds)]
        table[arm] = {
            "seeds": sorted(seeds),
            "figures": {name: stat([f[name] for f in per_seed]) for name in FIGURES},
        }

    def mean_of(arm: str | None, figure: str) -> float | None:
        return table[arm]["figures"][figure].mean if arm in table else None

    for arm, entry in table.items():
        entry["gap_closed_pct"] = gap_closed(mean_of(arm, DEPLOYED), mean_of(reference, DEPLOYED),
                                             mean_of(baseline, DEPLOYED))
        entry["relative_speed"] = relative_speed(mean_of(arm, "time_step"),
                                                 mean_of(reference, "time_step"))
    return table


@dataclass(frozen=True)
class Curve:
    """One metric of one arm per step, over its seeds: mean and the min-max band."""

    steps: list[int]
    mean: list[float]
    low: list[float]
    high: list[float]


def curve(seeds: Mapping[int, Rows], key: str, kind: str = "train") -> Curve:
    """`key` per step of rows of `kind` ('train' or 'eval'), across the seeds that have it."""
    by_step: dict[int, list[float]] = {}
    for rows in seeds.values():
        picked = train_rows(rows) if kind == "train" else eval_rows(rows)
        for row in picked:
            value = value_of(row, key)
            if value is not None:
                by_step.setdefault(int(row["step"]), []).append(value)
    steps = sorted(by_step)
    return Curve(steps, [statistics.fmean(by_step[s]) for s in steps],
                 [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps])
