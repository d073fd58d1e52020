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


def test_a_closed_engine_collected_later_leaves_the_next_one_running(tmp_path):
    """vLLM's distributed state (its model-parallel groups) is process-wide, and an in-process
    vLLM engine tears it down when the garbage collector takes it, which can be long after
    it was dropped (vLLM freezes the heap at every engine start and unfreezes it at a
    shutdown). `VLLMEngine.close()` shuts it down at once, so an engine closed before the
    next one starts and collected while that one runs leaves the next one working."""
    import gc

    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from qarl.config import load_config
    from qarl.train.data import sampling_params
    from qarl.train.policy import build_engine

    config = load_config("tiny", {"run.output_dir": str(tmp_path), "rollout.engine": "vllm",
                                  "quant.align": "fake", "rollout.max_new_tokens": 4})
    first = build_engine(config, run_dir=tmp_path / "first")
    assert model_parallel_is_initialized()
    first.close()
    assert not model_parallel_is_initialized()  # released now, not when first is collected
    first.close()  # idempotent
    del first  # its cycles stay: frozen by vLLM, then the next engine's start freezes them again
    second = build_engine(config, run_dir=tmp_path / "second")
    try:
        gc.unfreeze()
        gc.collect()  # the first engine goes now, while the second runs
        batch = second.generate([[5, 6, 7], [8, 9]], sampling_params(config.rollout), seed=0)
    finally:
        second.close()
    assert batch.response_ids.shape[0] == 2 and int(batch.response_lengths.min()) >= 1
