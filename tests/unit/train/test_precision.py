"""train.compute_dtype: what 'auto' picks, and that a bf16-master run only passes as a dry run."""

from __future__ import annotations

import pytest
import torch

from qarl.config import load_config
from qarl.train import precision


@pytest.mark.parametrize("bf16_math, want", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_is_bf16_only_where_the_cpu_has_bf16_arithmetic(monkeypatch, bf16_math, want):
    monkeypatch.setattr(precision, "has_bf16_math", lambda: bf16_math)
    assert precision.resolve_compute_dtype("auto", torch.device("cpu")) == want
    assert precision.resolve_compute_dtype("auto", torch.device("cuda")) == torch.bfloat16
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        assert precision.resolve_compute_dtype(name, torch.device("cpu")) == dtype
    line = precision.describe_compute(want, "auto")
    assert line.startswith(str(want).removeprefix("torch.")) and "'auto'" in line


def test_bf16_masters_load_for_a_run_that_trains_nothing():
    config = load_config("tiny", {"model.master_dtype": "bfloat16", "train.lr": 0.0,
                                  "sft.steps": 0})
    assert config.model.master_dtype == "bfloat16"
