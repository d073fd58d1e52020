"""eval.cache_dir: an evaluation is kept under the digest of what it depends on and read back,
instead of run again, by an evaluation with the same digest (qarl.train.evaluate)."""

from __future__ import annotations

import copy

import torch

from qarl.config import load_config
from qarl.report import read_metrics
from qarl.train.evaluate import evaluate
from qarl.train.folder import open_run
from qarl.train.sft import warm_start
from qarl.train.trainer import train


def _config(tmp_path, name: str, **extra):
    return load_config("tiny", {"run.output_dir": str(tmp_path), "run.name": name,
                                "log.progress": False, "eval.size": 8,
                                "eval.cache_dir": str(tmp_path / "cache"), **extra})


def _values(metrics: dict) -> dict:
    """The evaluation's figures, less its seconds and the shared flags (NaN, e.g. no 4-gram
    to repeat, as None: NaN equals nothing)."""
    return {k: None if v != v else v for k, v in metrics.items()
            if not k.startswith("time/") and not k.startswith("eval/shared_")}


def test_the_same_policy_evaluated_again_is_read_and_equals_a_run(tmp_path):
    """A second evaluation of the same weights reads both policies' figures from the cache
    (eval/shared_* = 1) and they equal those of the evaluation that ran; moving one weight or
    another seed is another digest, so it runs (and differs from the cached figures' run only
    as a fresh evaluation would)."""
    config = _config(tmp_path, "a")
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        policy.sync.push()
        first = evaluate(policy, data, config)
        again = evaluate(policy, data, config)
        assert "eval/shared_quantized" not in first
        assert again["eval/shared_quantized"] == again["eval/shared_full_precision"] == 1.0
        assert _values(again) == _values(first)
        assert len(list((tmp_path / "cache").glob("*.json"))) == 2  # one per policy
        other_seed = config.model_copy(update={"run": config.run.model_copy(update={"seed": 9})})
        assert "eval/shared_quantized" not in evaluate(policy, data, other_seed)
        with torch.no_grad():
            policy.learner.model.lm_head.weight[0, 0] += 1.0  # the full-precision copy moves
        moved = evaluate(policy, data, config)
        assert moved["eval/shared_quantized"] == 1.0  # the engine was not pushed: same weights
        assert "eval/shared_full_precision" not in moved
    assert len(list((tmp_path / "cache").glob("*.json"))) == 5


def test_two_runs_from_one_start_share_their_first_evaluation(tmp_path):
    """Two runs that differ only in their loss evaluate step 0 once: the second run's step-0
    row is read from the cache and equals the first's, the first run's final one runs; so
    does a naive learner's (its engine quantizes the same weights into the same codes, and
    keeps the master weights it was sent, which it never decodes with); a run without the
    cache gets the same step-0 figures."""
    rows = {}
    for name, extra in (("grpo", {"algo.loss": "grpo"}), ("tbpo", {"algo.loss": "tbpo"}),
                        ("naive", {"quant.align": "naive"}),
                        ("alone", {"algo.loss": "tbpo", "eval.cache_dir": ""})):
        config = _config(tmp_path, name, **{"train.steps": 1, **extra})
        train(config)
        rows[name] = [r for r in read_metrics(tmp_path / name / "metrics.jsonl")
                      if r["kind"] == "eval"]
    first, second, naive, alone = (rows[n][0] for n in ("grpo", "tbpo", "naive", "alone"))
    assert "eval/shared_quantized" not in first
    assert second["eval/shared_quantized"] == naive["eval/shared_quantized"] == 1.0
    assert _values(second) == _values(first) == _values(naive) == _values(alone)
    assert "eval/shared_quantized" not in rows["grpo"][-1]  # trained weights: a new digest
    # tbpo's one step may leave grpo's weights to the bit (at ratio 1 the two losses' gradients
    # agree, and Adam's first step is lr * g / |g|; so it is in a bf16 gradient pass): then its
    # final evaluation is grpo's, read back
    final = rows["tbpo"][-1]
    assert "eval/shared_quantized" not in final or _values(final) == _values(rows["grpo"][-1])
