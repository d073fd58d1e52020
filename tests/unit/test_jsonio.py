"""Every JSON file qarl writes is JSON: null where a figure is missing or not finite."""

from __future__ import annotations

import json
import math

import pytest

from qarl import jsonio


def strict(text: str):
    """json.loads that refuses NaN / Infinity, as jq and JavaScript do."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_become_null_at_any_depth():
    value = {"a": math.nan, "b": [1.0, math.inf, (-math.inf, 2)], "c": {"d": math.nan, "e": 3},
             "f": "NaN", "g": None, "h": True}
    text = jsonio.dumps(value, indent=1)
    assert strict(text) == {"a": None, "b": [1.0, None, [None, 2]], "c": {"d": None, "e": 3},
                            "f": "NaN", "g": None, "h": True}


def test_what_is_not_json_still_raises():
    with pytest.raises(TypeError):
        jsonio.dumps({"x": object()})


def test_metrics_rows_read_back_without_their_nulls(tmp_path):
    """A metrics.jsonl row's null (a figure missing at that step) is left out on reading."""
    from qarl.report import read_metrics

    (tmp_path / "m.jsonl").write_text(jsonio.dumps({"step": 1, "kind": "train",
                                                     "reward/mean": math.nan, "x": 2.0}) + "\n")
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 1, "kind": "train", "x": 2.0}]
