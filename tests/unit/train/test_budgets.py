"""Mismatch budgets (qarl/train/budgets.py): what each setup's budget is and when it flags."""

from __future__ import annotations

import json
import math

from qarl.quant import SCHEMES
from qarl.train.budgets import BUDGETS_FILE, mismatch_budget


def test_exact_setups_have_a_budget_of_zero_on_the_largest_difference():
    """Where the replay is exact by construction any difference at all is over budget."""
    budget = mismatch_budget("w8a8-int8", "kernel", "local", exact=True)
    assert (budget.metric, budget.limit) == ("mismatch/abs_diff_max", 0.0)
    assert budget.exceeded({"mismatch/abs_diff_max": 0.0}) is None
    assert "exceeds the w8a8-int8 kernel (local engine) budget of 0" in budget.exceeded(
        {"mismatch/abs_diff_max": 2 ** -24})


def test_measured_budgets_cover_every_scheme_and_approximate_alignment():
    """budgets.json has, for the local engine, every scheme but the identity under `fake` and
    `naive`: factor x the largest value measured, each value from qarl parity on both models."""
    table = json.loads(BUDGETS_FILE.read_text())
    local = table["engines"]["local"]["budgets"]
    assert sorted(local) == sorted(s for s in SCHEMES if s != "none")
    for scheme, per_align in local.items():
        assert sorted(per_align) == ["fake", "naive"]
        for align, entry in per_align.items():
            assert sorted(entry["measured"]) == ["smollm2-135m", "tiny"]
            assert math.isclose(entry["budget"], table["factor"] * max(entry["measured"].values()),
                                rel_tol=1e-3)
            budget = mismatch_budget(scheme, align, "local", exact=False)
            assert budget.metric == "mismatch/abs_diff_mean" and budget.limit == entry["budget"]


def test_over_budget_and_non_finite_steps_are_flagged_unmeasured_setups_have_none():
    budget = mismatch_budget("w4a16-int4", "fake", "local", exact=False)
    assert budget.exceeded({"mismatch/abs_diff_mean": budget.limit}) is None
    message = budget.exceeded({"mismatch/abs_diff_mean": budget.limit * 1.01})
    assert "a broken sync, a changed kernel, or a model outside the measured range" in message
    assert budget.exceeded({"mismatch/abs_diff_mean": math.nan}) is not None
    assert budget.exceeded({}) is None  # a step without the metric (no replayed row)
    assert mismatch_budget("w8a8-int8", "fake", "vllm", exact=False) is None
