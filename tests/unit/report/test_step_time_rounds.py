"""benchmarks/step_time.py --rounds: one process per arm and round, the order reversed every
other round, each round's ratios and the means (the child processes stubbed)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_time  # noqa: E402

STEPS = {("a", 0): 2.0, ("b", 0): 4.0, ("a", 1): 3.0, ("b", 1): 3.0}


def _args(rounds: int) -> argparse.Namespace:
    return argparse.Namespace(recipe="tiny", steps=3, tokens=8, ignore_eos=True, rounds=rounds)


def test_rounds_alternate_the_order_and_average_each_rounds_ratio(monkeypatch):
    calls = []

    def run(command, capture_output, text):
        arm = command[command.index("--arm") + 1]
        name = arm.partition(":")[0]
        calls.append((name, command))
        step = STEPS[(name, len([c for c in calls if c[0] == name]) - 1)]
        out = {"arms": {name: {"step": step, "update": step / 2, "ratio": 1.0,
                               "quant_backward": "codes"}},
               "peak_rss_gb": 1.5, "loadavg_before": [0.1, 0.1, 0.1]}
        return argparse.Namespace(returncode=0, stdout=json.dumps(out), stderr="")

    monkeypatch.setattr(step_time.subprocess, "run", run)
    result = step_time.in_processes(_args(2), ["a:", "b:quant.scheme=none"])
    assert [name for name, _ in calls] == ["a", "b", "b", "a"]
    # every child gets the options and exactly one arm
    assert all(c[c.index("--tokens") + 1] == "8" and "--ignore-eos" in c
               and c.count("--arm") == 1 for _, c in calls)
    assert [r["b"]["ratio"] for r in result["rounds"]] == [0.5, 1.0]
    assert result["arms"]["b"]["ratio"] == 0.75  # the mean of the rounds' ratios
    assert result["arms"]["a"]["step"] == 2.5 and result["arms"]["b"]["update"] == 1.75
    assert result["arms"]["b"]["quant_backward"] == "codes"


def test_a_failing_arm_stops_with_its_error(monkeypatch):
    monkeypatch.setattr(step_time.subprocess, "run", lambda *a, **k: argparse.Namespace(
        returncode=1, stdout="", stderr="ValueError: bad override"))
    with pytest.raises(SystemExit, match=r"(?s)arm .a:. failed \(exit 1\).*bad override"):
        step_time.in_processes(_args(1), ["a:"])
