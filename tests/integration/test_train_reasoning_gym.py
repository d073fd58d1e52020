"""`qarl train --task.name=reasoning_gym --task.options=...` on the tiny model, as a user
types it: problems generated offline, rewarded by reasoning-gym's scorer in the workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qarl.report import read_metrics

pytest.importorskip("reasoning_gym")

HERE = Path(__file__).resolve().parent


def test_qarl_train_on_a_reasoning_gym_generator(tmp_path):
    """The command finishes two steps and both evaluations; every reward call is scored (no
    error or timeout), and the eval rows hold the held-out accuracy."""
    options = '{dataset = "chain_sum", min_terms = 2, max_terms = 2, max_digits = 1, ' \
              'system = "direct", eval_problems = 16}'
    args = ["train", "tiny", f"--run.output_dir={tmp_path}", "--task.name=reasoning_gym",
            f"--task.options={options}", "--task.max_prompt_tokens=512", "--train.steps=2",
            "--rollout.batch_size=16", "--train.micro_batch_size=16", "--eval.size=16",
            "--eval.full_precision=false", "--sft.steps=2"]
    done = subprocess.run([sys.executable, str(HERE / "run_qarl.py"), *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(tmp_path / "tiny" / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 2
    assert all(r["reward/ok"] == 1.0 and r["reward/error"] == 0.0 for r in train)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert len(evals) == 2 and all(0 <= r["eval/accuracy_quantized"] <= 1 for r in evals)
