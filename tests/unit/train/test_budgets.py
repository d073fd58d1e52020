"""The run's mismatch budget (qarl/train/budgets.py): 0 where the replay is exact by
construction, else calibrated on the run's first step; flagged once per episode."""

from __future__ import annotations

import math

import pytest

from qarl.config import load_config
from qarl.train.budgets import FLOOR, MismatchBudget, OverBudget, RunContract


def test_exact_setups_have_a_budget_of_zero_on_the_largest_difference():
    """Where the replay is exact by construction any difference at all is over budget."""
    budget = MismatchBudget(exact=True, factor=4.0)
    assert (budget.metric, budget.limit) == ("mismatch/abs_diff_max", 0.0)
    assert budget.exceeded({"mismatch/abs_diff_max": 0.0}) is None
    assert "abs_diff_max = 5.96e-08, where learner and engine compute the same bits" in (
        budget.exceeded({"mismatch/abs_diff_max": 2 ** -24}))


def test_a_calibrated_budget_takes_the_first_step_and_says_how_far_a_step_is():
    """The first finite mean mismatch is the reference (never flagged); a later step is
    within factor x it, or flagged with its value and how many times the reference it is; a
    non-finite step is over; a reference of 0 keeps the FLOOR."""
    budget = MismatchBudget(exact=False, factor=4.0)
    assert budget.limit is None and budget.exceeded({}) is None
    assert budget.exceeded({"mismatch/abs_diff_mean": math.nan}) is None  # no reference yet
    assert budget.exceeded({"mismatch/abs_diff_mean": 0.002}) is None
    assert budget.reference == 0.002 and budget.limit == 0.008
    assert budget.exceeded({"mismatch/abs_diff_mean": 0.0079}) is None
    problem = budget.exceeded({"mismatch/abs_diff_mean": 0.03})
    assert problem.startswith("mismatch/abs_diff_mean = 0.03 is 15 x the 0.002 of the run's "
                              "first step (budget 4 x = 0.008)")
    assert budget.exceeded({"mismatch/abs_diff_mean": math.inf}) is not None
    zero = MismatchBudget(exact=False, factor=4.0)
    zero.exceeded({"mismatch/abs_diff_mean": 0.0})
    assert zero.limit == FLOOR and zero.exceeded({"mismatch/abs_diff_mean": FLOOR / 2}) is None


def _contract(**overrides):
    return RunContract(load_config("tiny", {"quant.align": "fake", **overrides}), exact=False)


def test_over_budget_is_one_episode_with_a_line_when_it_starts_and_clears():
    """Steps 2-3 over, step 4 back: contract/over_budget 1 on each over step, a log line at
    step 2 and at step 4 only; the state (reference, episode) survives a checkpoint; with
    over_budget = 'stop' the first over step raises OverBudget."""
    contract = _contract()
    seen = []
    for step, value in enumerate([0.01, 0.5, 0.6, 0.01]):
        metrics = contract.check_step({"mismatch/abs_diff_mean": value}, step)
        seen.append((metrics["contract/over_budget"], contract.alert))
    assert [over for over, _ in seen] == [0.0, 1.0, 1.0, 0.0]
    assert seen[1][1].startswith("step 2: over the mismatch budget: mismatch/abs_diff_mean = 0.5")
    assert seen[2][1] == "" and seen[3][1] == "step 4: back within the mismatch budget"
    restored = _contract()
    restored.restore(contract.state())
    assert restored.budget.limit == pytest.approx(0.04)
    stopping = _contract(**{"quant.over_budget": "stop"})
    stopping.check_step({"mismatch/abs_diff_mean": 0.01}, 0)
    with pytest.raises(OverBudget, match="is 50 x .*quant.over_budget = 'stop'"):
        stopping.check_step({"mismatch/abs_diff_mean": 0.5}, 1)


def test_the_budget_is_exact_only_on_the_cpu():
    """On CUDA the learner's kernels are not the engine's bits: its budget is calibrated."""
    cpu = load_config("tiny")
    cuda = cpu.model_copy(update={"train": cpu.train.model_copy(update={"device": "cuda"})})
    assert RunContract(cpu, exact=True).budget.exact
    assert not RunContract(cuda, exact=True).budget.exact
