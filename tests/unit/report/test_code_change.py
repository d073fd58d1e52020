"""benchmarks/code_change.py: `following` (how much of the master's movement the deployed
weights make), the summary and the table, and its quick mode end to end on `tiny`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import code_change  # noqa: E402


def _snap(master: torch.Tensor, deployed: torch.Tensor) -> dict:
    return {"model.layers.0.mlp.up_proj": (master, deployed)}


def test_following_is_one_when_the_deployed_weights_move_with_the_master():
    g = torch.Generator().manual_seed(0)
    w0, step = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g) * 1e-3
    out = code_change.following(_snap(w0, w0), _snap(w0 + step, w0 + step))
    assert out["followed"] == pytest.approx(1.0, abs=1e-12) and out["noise"] == pytest.approx(0)


def test_following_is_zero_for_frozen_codes_and_the_noise_is_their_whole_movement():
    """Deployed weights that never change followed none of the master's movement, and strayed
    from it by exactly its own size (noise 1); a deployed move of twice the master's along it
    reads 2."""
    g = torch.Generator().manual_seed(1)
    w0, q0, step = (torch.randn(8, 16, generator=g) for _ in range(3))
    frozen = code_change.following(_snap(w0, q0), _snap(w0 + step, q0))
    assert frozen["followed"] == 0.0 and frozen["noise"] == pytest.approx(1.0)
    double = code_change.following(_snap(w0, q0), _snap(w0 + step, q0 + 2 * step))
    assert double["followed"] == pytest.approx(2.0) and double["noise"] == pytest.approx(1.0)
    assert code_change.following(_snap(w0, q0), _snap(w0, q0 + step)) == {
        "followed": None, "noise": None}  # the master did not move: no share to read


def test_summary_and_table_hold_every_kind_and_cell():
    steps = [{"codes": 0.01, "kinds": {"q_proj": 0.02, "down_proj": 0.0}, "followed": 0.5,
              "noise": 3.0, "no_signal": 0.0},
             {"codes": 0.03, "kinds": {"q_proj": 0.04, "down_proj": 0.01}, "followed": 0.9,
              "noise": 2.0, "no_signal": 1.0}]
    cell = {"format": "int4-g64", "lr": 1e-5, "steps": steps,
            "accuracy": {"before": {"deployed": 0.25, "master": 0.5},
                         "after": {"deployed": 0.5, "master": 0.75}}}
    cell["summary"] = code_change.summarize(cell)
    assert cell["summary"]["codes_per_step"] == pytest.approx(0.02)
    assert cell["summary"]["kinds_per_step"] == pytest.approx({"q_proj": 0.03, "down_proj": 0.005})
    assert (cell["summary"]["followed"], cell["summary"]["no_signal_steps"]) == (0.9, 1)
    table = code_change.markdown([cell])
    head, _, row = table.splitlines()
    assert "| q_proj | down_proj |" in head  # block order: attention before the MLP
    assert row.startswith("| W4A16 int4 g64 | 1e-05 | 2.000% | 3.000% | 0.500% | 0.90 |")
    assert row.endswith("| 0.25 -> **0.50** | 0.50 -> 0.75 |")
    what, reading = code_change.glance({"recipe": "compare", "cells": [cell]})
    assert "lr 1e-05, 1 formats" in what and reading.startswith("2.000-2.000% per step")
    assert code_change.glance({"recipe": "compare", "cells": [cell]}, lr=1e-4) is None


def test_quick_cell_runs_and_counts_the_first_step(tmp_path):
    """One quick cell on `tiny`: a step's codes change (its push is compared with the starting
    weights), per kind of layer too, the deployed weights follow the master's movement on
    average, and both policies are evaluated before and after."""
    recipe, _, batch, group, eval_size, lrs, _ = code_change.SIZES["quick"]
    cell = code_change.measure_cell(recipe, "int8", lrs[0], {
        "steps": 1, "batch": batch, "group": group, "eval": eval_size}, str(tmp_path))
    (step,) = cell["steps"]
    assert 0 < step["codes"] < 1 and set(step["kinds"]) == set(code_change.KINDS)
    assert 0.9 < step["followed"] < 1.1
    assert all(v is not None for side in cell["accuracy"].values() for v in side.values())
