"""The quantization contract of a run: checked at the start, after every sync, at every step.

- At the start (`RunContract.start`, before the first weight push): the layer table of
  qarl/quant/contract.py, saved as `contract.json` in the run folder and summarized in the
  log; a layer quantized on one side only (not exempted by `quant.contract_exempt`) stops the
  run before step 1 (`ContractBroken`).
- After every weight sync: the engine replicas' digests against the learner's
  (`WeightSync.verify`, `quant.sync_check`).
- Every step, after old_logp and before the update (`RunContract.check_step`): the step's
  mismatch against the budget of its (scheme, align, engine) (qarl/quant/budgets.py).
  Over budget: `contract/over_budget` = 1 in the metrics and a log line; with
  `quant.over_budget = "stop"` the run ends there (`OverBudget`), before that step's update,
  its last checkpoint intact. `contract/budget` is the limit (absent: no budget here).
"""

from __future__ import annotations

import json
from pathlib import Path

from qarl.config import RunConfig
from qarl.quant.budgets import Budget, mismatch_budget
from qarl.quant.contract import check_table, table_json, table_summary
from qarl.train.sync import WeightSync

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
        # budgets are CPU measurements of the decode-path replay (qarl/quant/budgets.py): none
        # for another device or for the teacher-forced forward's values (train.logp_path)
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
