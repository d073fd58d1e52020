"""`qarl train` with rollout.engine = "vllm" end to end on tiny (`make test-vllm`; skipped
without vllm): w8a8-int8 rollouts from vLLM in the dtype auto picks on this CPU (bfloat16 where
vLLM's int8 kernel takes only 16-bit activations: the AMX pass of `make test-vllm`), `fake`
alignment, TBPO."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

import qarl  # noqa: E402


def test_train_with_vllm_int8_rollouts(tmp_path):
    """Two RL steps: every step logs a finite mismatch between the fake learner and vLLM's
    int8 sampler (within the tiny model's scale: < 0.5 nats mean per token) and generated
    tokens; the run ends with its summary and final checkpoint."""
    summary = qarl.train("tiny", overrides={
        "rollout.engine": "vllm", "quant.align": "fake", "train.steps": 2, "eval.size": 8,
        "eval.full_precision": False, "run.output_dir": str(tmp_path)})
    run = tmp_path / "tiny"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("kind", "train") == "train" and "mismatch/abs_diff_mean" in s]
    assert len(steps) == 2
    for s in steps:
        assert 0 <= s["mismatch/abs_diff_mean"] < 0.5, s["mismatch/abs_diff_mean"]
        assert s["response/length_mean"] > 0
    assert summary["after"] and (run / "step_000002").is_dir()
