"""The run's quantization contract and its mismatch budget, checked at the start, at every
sync and at every step.

- At the start (`RunContract.start`, before the first weight push): the layer table of
  qarl/quant/contract.py, saved as `contract.json` in the run folder and summarized in the
  log; a layer quantized on one side only (not exempted by `quant.contract_exempt`) stops the
  run before step 1 (`ContractBroken`).
- At every weight sync (`WeightSync.push`): the quantizer settings of every pushed layer
  against the engine's (refused on a difference, before the engine takes it), then the
  engine replicas' digests against the learner's (`quant.sync_check`).
- Every step, after old_logp and before the update (`RunContract.check_step`): the step's
  learner-vs-sampler mismatch against the run's budget (`MismatchBudget`):
  - exact by construction (`kernel` alignment or full-precision rollouts, qarl's own engine,
    a dense model, on the CPU: where the replay audit of qarl/train/learner/audit.py holds):
    the largest per-token difference must be 0; any bit is over;
  - everywhere else (`fake`, `naive`, vLLM, MoE, CUDA; either `train.logp_path`): calibrated
    on the run itself. The first step's mean per-token difference is the reference (the
    engine then holds exactly the learner's starting weights, as the start's digests showed);
    every later step's must stay within `quant.budget_factor` x the reference (and never
    below `FLOOR`). A resumed run keeps its reference (`state()`, in the checkpoint).
  Over budget: `contract/over_budget` = 1 at the step; the log says when it starts (the
  metric, its value and how many times the reference it is) and when it clears; with
  `quant.over_budget = "stop"` the run ends there (`OverBudget`), before that step's update,
  its last checkpoint intact. `contract/budget` is the limit once it is known.
  A stale step (train.async_rollouts: a batch sampled by the weights before the learner's
  last update) is not checked: its mismatch is the policy's one-step move on top of the
  engine's, which no budget of the engine's bounds (`contract/over_budget` is absent there,
  and a calibrated budget's reference comes from a step that is not stale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from qarl import jsonio
from qarl.config import RunConfig
from qarl.quant.contract import check_table, table_json, table_summary
from qarl.train.sync import WeightSync

MEAN_KEY, MAX_KEY = "mismatch/abs_diff_mean", "mismatch/abs_diff_max"
# The smallest calibrated budget, in nats per token: a reference of exactly 0 (a fake learner
# that happens to compute the engine's bits) would otherwise flag one rounding flip.
FLOOR = 1e-4
CONTRACT_FILE = "contract.json"


class OverBudget(RuntimeError):
    """A step's mismatch exceeded its budget with quant.over_budget = 'stop'."""


@dataclass
class MismatchBudget:
    """The mismatch a step may show (module docstring). `exact`: 0 on `MAX_KEY`; otherwise
    `factor` x `reference`, the first measured step's `MEAN_KEY` (None until it is)."""

    exact: bool
    factor: float
    reference: float | None = None

    @property
    def metric(self) -> str:
        return MAX_KEY if self.exact else MEAN_KEY

    @property
    def limit(self) -> float | None:
        if self.exact:
            return 0.0
        return None if self.reference is None else max(FLOOR, self.factor * self.reference)

    def describe(self) -> str:
        if self.exact:
            return f"mismatch budget {MAX_KEY} <= 0 (exact by construction)"
        return (f"mismatch budget {MEAN_KEY} <= {self.factor:g} x step 1's (calibrated on "
                "the run)" if self.reference is None else
                f"mismatch budget {MEAN_KEY} <= {self.limit:.4g} ({self.factor:g} x the "
                f"{self.reference:.4g} the run's first step measured)")

    def exceeded(self, metrics: dict[str, float]) -> str | None:
        """A sentence when the step's metric is over the limit (or not finite), else None; the
        first finite value of a calibrated budget becomes its reference."""
        value = metrics.get(self.metric)
        if value is None:
            return None
        if not self.exact and self.reference is None:
            if math.isfinite(value):
                self.reference = value
            return None
        if math.isfinite(value) and value <= self.limit:
            return None
        if self.exact:
            return (f"{MAX_KEY} = {value:.4g}, where learner and engine compute the same bits "
                    "(exact by construction): a broken sync, a stale engine, or a kernel that "
                    "changed")
        times = value / self.reference if self.reference > 0 else math.inf
        return (f"{MEAN_KEY} = {value:.4g} is {times:.3g} x the {self.reference:.4g} of the "
                f"run's first step (budget {self.factor:g} x = {self.limit:.4g}): a stale or "
                "broken engine, a layer the engine computes otherwise, or a policy that moved "
                "far from what the engine samples")


class RunContract:
    def __init__(self, config: RunConfig, exact: bool, state: dict | None = None):
        """`exact`: the replay is exact by construction here (qarl.train.policy.replay_is_exact)
        and the learner runs on the CPU; `state`: a checkpoint's `state()`."""
        quant = config.quant
        self.quant, self.stop = quant, quant.over_budget == "stop"
        on_cpu = config.train.device == "cpu"
        self.budget = MismatchBudget(exact and on_cpu, quant.budget_factor)
        self.over = False  # in an over-budget episode
        self.alert = ""  # what started or cleared at the last step ("" when nothing)
        if state:
            self.restore(state)

    def state(self) -> dict:
        """What a checkpoint keeps: the calibrated reference and the episode."""
        return {"reference": self.budget.reference, "over": self.over}

    def restore(self, state: dict) -> None:
        self.budget.reference = state.get("reference")
        self.over = bool(state.get("over", False))

    def start(self, sync: WeightSync, run_dir: Path) -> str:
        """Write the layer table to run_dir/contract.json and check it; returns the log line."""
        rows = sync.contract_table(self.quant)
        budget = self.budget
        document = {"budget": {"metric": budget.metric, "exact": budget.exact,
                               "factor": None if budget.exact else budget.factor,
                               "reference": budget.reference},
                    "sync_check": self.quant.sync_check, "layers": table_json(rows)}
        (run_dir / CONTRACT_FILE).write_text(jsonio.dumps(document, indent=1) + "\n")
        check_table(rows)
        return (f"quantization contract: {table_summary(rows)}; {budget.describe()} "
                f"({CONTRACT_FILE})")

    def check_step(self, samples: dict[str, float], step: int,
                   stale: bool = False) -> dict[str, float]:
        """The budget metrics of step `step` (0-based) from its sample metrics, and `alert`;
        raises OverBudget when over with over_budget = 'stop'. A `stale` step is not checked
        (module docstring)."""
        self.alert = ""
        if stale:
            limit = self.budget.limit
            return {} if limit is None else {"contract/budget": limit}
        problem = self.budget.exceeded(samples)
        if problem is not None and not self.over:
            self.alert = f"step {step + 1}: over the mismatch budget: {problem}"
        elif problem is None and self.over:
            self.alert = f"step {step + 1}: back within the mismatch budget"
        self.over = problem is not None
        if problem is not None and self.stop:  # the trainer names the step
            raise OverBudget(f"{problem}; quant.over_budget = 'stop' ended the run before "
                             "this step's update")
        metrics = {"contract/over_budget": float(problem is not None)}
        if self.budget.limit is not None:
            metrics["contract/budget"] = self.budget.limit
        return metrics
