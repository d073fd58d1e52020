"""Mismatch budgets: how far the learner's old_logp may be from the sampler's logprobs for a
(scheme, align, engine) before a step is suspect.

- Exact by construction (`kernel` alignment, or full-precision rollouts, with qarl's own
  engine on CPU and a dense model: the cases where the replay audit of qarl/train/audit.py
  holds): the budget is 0, judged on the largest per-token difference (any bit is over).
- `fake` / `naive`: `budgets.json` beside this file, written by
  `benchmarks/mismatch_budgets.py`: `qarl parity` per model and scheme, the mean per-token
  |old_logp - rollout_logp| (`mismatch/abs_diff_mean` in a step's metrics) measured on each
  model, and the budget `factor` x the largest measured value (the headroom covers other
  prompts, longer responses and the weights moving in training: the shipped recipes' steps
  stay below it, docs/training.md "The quantization contract").
  Engines are keyed as `qarl parity` labels them (`EngineKind.label`): "local", or vLLM with
  the dtype it computes in ("vllm float32"), since vLLM's bf16 path has a mismatch of its own.
- Anything else (a vLLM dtype not measured, a CUDA learner, a scheme registered later): no
  budget, and the run's log says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

BUDGETS_FILE = Path(__file__).with_name("budgets.json")
MEAN_KEY, MAX_KEY = "mismatch/abs_diff_mean", "mismatch/abs_diff_max"


@dataclass(frozen=True)
class Budget:
    """The mismatch a step may show: `limit` on `metric` (a step-metrics key)."""

    name: str  # e.g. "w8a8-int8 fake (local engine)"
    metric: str
    limit: float
    source: str  # where the number comes from, for the log

    def exceeded(self, metrics: dict[str, float]) -> str | None:
        """A sentence when the step's `metric` is over the limit (or not finite), else None."""
        value = metrics.get(self.metric)
        if value is None or (math.isfinite(value) and value <= self.limit):
            return None
        return (f"{self.metric} = {value:.4g} exceeds the {self.name} budget of "
                f"{self.limit:.4g} ({self.source}): a broken sync, a changed kernel, or a model "
                "outside the measured range")


@cache
def _table() -> dict:
    return json.loads(BUDGETS_FILE.read_text())


def mismatch_budget(scheme: str, align: str, engine: str, exact: bool) -> Budget | None:
    """The budget of a run (module docstring); `engine`: the engine's label ("local",
    "vllm float32"); `exact`: its replay is exact by construction."""
    name = f"{scheme} {align} ({engine} engine)"
    if exact:
        return Budget(name, MAX_KEY, 0.0, "exact by construction")
    table = _table()
    entry = table["engines"].get(engine, {}).get("budgets", {}).get(scheme, {}).get(align)
    if entry is None:
        return None
    return Budget(name, MEAN_KEY, entry["budget"],
                  f"{table['factor']:g} x the largest of {entry['measured']} measured by "
                  "qarl parity")
