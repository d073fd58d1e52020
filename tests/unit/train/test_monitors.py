"""The length-collapse and degeneration monitors (qarl/train/monitors.py) on planted series."""

from __future__ import annotations

import math

import pytest

from qarl.config import MonitorSection
from qarl.train.monitors import Monitors


def _feed(monitors, lengths, entropy=None, repeats=None):
    out = []
    for i, length in enumerate(lengths):
        out.append(monitors.update({
            "response/length_mean": length,
            "policy/entropy": 1.0 if entropy is None else entropy[i],
            "errors/rep_ngram": 0.0 if repeats is None else repeats[i]}))
    return out


def test_nothing_before_two_windows_then_ratios():
    """With window 3 the first 5 steps log nothing; step 6 compares steps 4-6 with 1-3."""
    monitors = Monitors(MonitorSection(window=3))
    out = _feed(monitors, [10, 12, 14, 10, 10, 10])
    assert out[:5] == [{}] * 5
    assert out[5]["monitor/length_ratio"] == pytest.approx(30 / 36)
    assert out[5]["monitor/entropy_ratio"] == 1.0 and out[5]["monitor/rep_ngram_rise"] == 0.0
    assert out[5]["monitor/alert"] == 0.0 and monitors.alert == ""


def test_length_collapse_fires_at_the_step_it_crosses_the_threshold():
    """Lengths 10, 10, 10, 10, 6, 3 (window 2): step 4 ratio 1, step 5 0.8, step 6 0.45 < 0.5:
    the alert fires at step 6, naming the monitor, the numbers and the option."""
    monitors = Monitors(MonitorSection(window=2))
    out = _feed(monitors, [10, 10, 10, 10, 6, 3])
    assert [o.get("monitor/alert") for o in out] == [None, None, None, 0.0, 0.0, 1.0]
    assert monitors.alert == ("step 6: length collapse: response/length_mean 4.5 over the last "
                              "2 steps vs 10 over the first 2 (ratio 0.45, "
                              "monitor.length_drop = 0.5)")


def test_entropy_collapse_and_degeneration():
    """Entropy falling to 2% of its baseline and repeated 4-grams rising by 0.3 both fire; a
    threshold of 0 turns its monitor's alert off, not its metric."""
    series = dict(lengths=[10] * 4, entropy=[1.0, 1.0, 0.02, 0.02], repeats=[0, 0, 0.3, 0.3])
    monitors = Monitors(MonitorSection(window=2))
    out = _feed(monitors, **series)
    assert out[3]["monitor/alert"] == 1.0
    assert "entropy collapse" in monitors.alert and "degeneration" in monitors.alert
    quiet = Monitors(MonitorSection(window=2, entropy_drop=0, repeat_rise=0))
    out = _feed(quiet, **series)
    assert out[3]["monitor/alert"] == 0.0 and out[3]["monitor/entropy_ratio"] == 0.02
    assert out[3]["monitor/rep_ngram_rise"] == pytest.approx(0.3)


def test_non_finite_values_are_left_out_and_the_state_round_trips():
    """A nan (no response with 4 tokens) is left out of its window's mean; a monitor restored
    from state() continues exactly as the uninterrupted one."""
    section = MonitorSection(window=2)
    whole, first = Monitors(section), Monitors(section)
    lengths, repeats = [10, 8, 4, 4, 3], [0.1, math.nan, 0.2, 0.3, 0.4]
    out = _feed(whole, lengths, repeats=repeats)
    assert out[3]["monitor/rep_ngram_rise"] == pytest.approx(0.25 - 0.1)
    _feed(first, lengths[:3], repeats=repeats[:3])
    resumed = Monitors(section, first.state())
    assert _feed(resumed, lengths[3:], repeats=repeats[3:]) == out[3:]
