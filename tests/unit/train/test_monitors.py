"""The length-collapse, entropy-collapse and degeneration monitors (qarl/train/monitors.py)
on planted series: each alert logged once per episode, length judged against the reward."""

from __future__ import annotations

import math

import pytest

from qarl.config import MonitorSection
from qarl.train.monitors import Monitors


def _feed(monitors, lengths, entropy=None, repeats=None, rewards=None, alerts=None):
    """The monitor metrics of each step; `alerts` collects each step's alert line."""
    out = []
    for i, length in enumerate(lengths):
        metrics = {"response/length_mean": length,
                   "policy/entropy": 1.0 if entropy is None else entropy[i],
                   "errors/rep_ngram": 0.0 if repeats is None else repeats[i]}
        if rewards is not None:
            metrics["reward/mean"] = rewards[i]
        out.append(monitors.update(metrics))
        if alerts is not None:
            alerts.append(monitors.alert)
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
    """Lengths 10, 10, 10, 10, 6, 3 (window 2) with no reward logged: step 4 ratio 1, step 5
    0.8, step 6 0.45 < 0.5: the alert starts at step 6, naming the monitor, the numbers and
    the option."""
    monitors = Monitors(MonitorSection(window=2))
    out = _feed(monitors, [10, 10, 10, 10, 6, 3])
    assert [o.get("monitor/alert") for o in out] == [None, None, None, 0.0, 0.0, 1.0]
    assert monitors.started
    assert monitors.alert == ("step 6: length collapse: response/length_mean 4.5 over the last "
                              "2 steps vs 10 over the first 2 (ratio 0.45, "
                              "monitor.length_drop = 0.5) (alert)")


def test_an_alert_is_logged_when_it_starts_and_when_it_clears_only():
    """A length collapse with a falling reward that lasts three steps and recovers: one line
    when it starts, none while it lasts (monitor/alert stays 1), one when it clears."""
    monitors = Monitors(MonitorSection(window=2))
    alerts = []
    out = _feed(monitors, [10, 10, 3, 3, 3, 3, 10, 10], rewards=[1, 1, 0.5, 0.5, 0.5, 0.5, 1, 1],
                alerts=alerts)
    assert [o.get("monitor/alert") for o in out][3:] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert [bool(a) for a in alerts] == [False, False, False, True, False, False, True, False]
    assert alerts[3].startswith("step 4: length collapse:") and alerts[3].endswith("(alert)")
    assert alerts[6] == "step 7: length collapse: cleared"


def test_shorter_answers_at_a_steady_or_rising_reward_are_not_a_collapse():
    """A policy that learns to answer in 3 tokens instead of 7 while its reward holds (within
    reward_hold) or rises: no alert, the ratio still logged; the same drop with the reward
    down to a half is a collapse."""
    lengths = [7, 7, 7, 3, 3, 3]
    for rewards in ([0.5, 0.5, 0.5, 0.48, 0.47, 0.49], [0.2, 0.2, 0.3, 0.6, 0.7, 0.8]):
        monitors = Monitors(MonitorSection(window=3))
        out = _feed(monitors, lengths, rewards=rewards)
        assert out[5]["monitor/alert"] == 0.0 and out[5]["monitor/length_ratio"] == 3 / 7
    monitors = Monitors(MonitorSection(window=3))
    out = _feed(monitors, lengths, rewards=[0.5, 0.5, 0.5, 0.25, 0.25, 0.25])
    assert out[5]["monitor/alert"] == 1.0 and out[5]["monitor/reward_ratio"] == 0.5
    negative = Monitors(MonitorSection(window=3))  # rewards below 0: steady is steady
    out = _feed(negative, lengths, rewards=[-1, -1, -1, -1, -1.05, -1])
    assert out[5]["monitor/alert"] == 0.0


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
    from state() (through JSON, where a nan is null, as a checkpoint holds it) continues
    exactly as the uninterrupted one, its open episode included."""
    import json

    from qarl import jsonio

    section = MonitorSection(window=2)
    whole, first = Monitors(section), Monitors(section)
    lengths, repeats = [10, 8, 4, 4, 3, 3], [0.1, math.nan, 0.2, 0.3, 0.4, 0.4]
    alerts = []
    out = _feed(whole, lengths, repeats=repeats, alerts=alerts)
    assert out[3]["monitor/rep_ngram_rise"] == pytest.approx(0.25 - 0.1)
    _feed(first, lengths[:4], repeats=repeats[:4])
    resumed = Monitors(section, json.loads(jsonio.dumps(first.state())))
    again = []
    assert _feed(resumed, lengths[4:], repeats=repeats[4:], alerts=again) == out[4:]
    assert again == alerts[4:]
