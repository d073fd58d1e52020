"""The run's quantization contract and its mismatch budgets, checked at the start, after every
sync and at every step.

- At the start (`RunContract.start`, before the first weight push): the layer table of
  qarl/quant/contract.py, saved as `contract.json` in the run folder and summarized in the
  log; a layer quantized on one side only (not exempted by `quant.contract_exempt`) stops the
  run before step 1 (`ContractBroken`).
- After every weight sync: the engine replicas' digests against the learner's
  (`WeightSync.verify`, `quant.sync_check`).
- Every step, after old_logp and before the update (`RunContract.check_step`): the step's
  mismatch against the budget of its (scheme, align, engine). Over budget:
  `contract/over_budget` = 1 in the metrics and a log line; with `quant.over_budget = "stop"`
  the run ends there (`OverBudget`), before that step's update, its last checkpoint intact.
  `contract/budget` is the limit (absent: no budget here).

Mismatch budgets: how far the learner's old_logp may be from the sampler's logprobs for a
(scheme, align, engine) before a step is suspect.

- Exact by construction (`kernel` alignment, or full-precision rollouts, with qarl's own
  engine on CPU and a dense model: the cases where the replay audit of
  qarl/train/learner/audit.py holds): the budget is 0, judged on the largest per-token
  difference (any bit is over).
- `fake` / `naive`: `budgets.json` beside this file, written by
  `benchmarks/mismatch_budgets.py`: `qarl parity` per model and scheme, the mean per-token
  |old_logp - rollout_logp| (`mismatch/abs_diff_mean` in a step's metrics) measured on each
  model, and the budget `factor` x the largest measured value.
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

from qarl.config import RunConfig
from qarl.quant.contract import check_table, table_json, table_summary
from qarl.train.sync import WeightSync

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


CONTRACT_FILE = "contract.json"


class OverBudget(RuntimeError):
    """A step's mismatch exceeded its budget with quant.over_budget = 'stop'."""


class RunContract:
    def __init__(self, config: RunConfig, exact: bool, engine: str = "local"):
        """`exact`: the replay is exact by construction; `engine`: the built engine's label
        (`EngineKind.label`, e.g. "vllm float32")."""
        quant = config.quant
        self.quant, self.stop = quant, quant.over_budget == "stop"
        on_cpu = config.train.device == "cpu"
        # budgets are CPU measurements of the decode-path replay (module docstring): none for
        # another device or for the teacher-forced forward's values (train.logp_path)
        measured = on_cpu and config.train.logp_path == "decode"
        self.budget: Budget | None = (
            mismatch_budget(quant.scheme, quant.align, engine, exact) if measured else None)
        self.alert = ""  # the last over-budget sentence

    def start(self, sync: WeightSync, run_dir: Path) -> str:
        """Write the layer table to run_dir/contract.json and check it; returns the log line."""
        rows = sync.contract_table(self.quant)
        document = {"budget": None if self.budget is None else vars(self.budget),
                    "sync_check": self.quant.sync_check, "layers": table_json(rows)}
        (run_dir / CONTRACT_FILE).write_text(json.dumps(document, indent=1) + "\n")
        check_table(rows)
        budget = ("no mismatch budget measured for this setup" if self.budget is None else
                  f"mismatch budget {self.budget.metric} <= {self.budget.limit:g} "
                  f"({self.budget.source})")
        return f"quantization contract: {table_summary(rows)}; {budget} ({CONTRACT_FILE})"

    def check_step(self, samples: dict[str, float], step: int) -> dict[str, float]:
        """The budget metrics of step `step` (0-based) from its sample metrics; raises
        OverBudget when over with over_budget = 'stop'."""
        if self.budget is None:
            return {}
        problem = self.budget.exceeded(samples)
        if problem is not None:
            self.alert = f"step {step + 1}: {problem}"
            if self.stop:  # the trainer names the step
                raise OverBudget(f"{problem}; quant.over_budget = 'stop' ended the run before "
                                 "this step's update")
        return {"contract/over_budget": float(problem is not None),
                "contract/budget": self.budget.limit}
