"""train.compute_dtype: what 'auto' picks, and that a bf16-master run only passes as a dry run."""

from __future__ import annotations

import pytest
import torch

from qarl.config import load_config
from qarl.train import precision


@pytest.mark.parametrize("bf16_math", [True, False])
def test_auto_is_fp32_on_every_cpu_and_bf16_on_cuda(monkeypatch, bf16_math):
    """'auto' never picks bf16 on a CPU, with bf16 arithmetic or without (a bf16 gradient pass
    learned worse on the default recipe); the log line says why, per CPU."""
    monkeypatch.setattr(precision, "has_bf16_math", lambda: bf16_math)
    assert precision.resolve_compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert precision.resolve_compute_dtype("auto", torch.device("cuda")) == torch.bfloat16
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        assert precision.resolve_compute_dtype(name, torch.device("cpu")) == dtype
    line = precision.describe_compute(torch.float32, "auto")
    assert line.startswith("float32") and "'auto'" in line
    assert ("learns worse" in line) == bf16_math and ("no bf16 arithmetic" in line) != bf16_math
    assert precision.describe_compute(torch.bfloat16, "auto").startswith("bfloat16")


def test_bf16_masters_load_for_a_run_that_trains_nothing():
    config = load_config("tiny", {"model.master_dtype": "bfloat16", "train.lr": 0.0,
                                  "sft.steps": 0})
    assert config.model.master_dtype == "bfloat16"
