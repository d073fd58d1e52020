"""Training on a user's dataset file with a user's reward: bad input is counted, not fatal."""

from __future__ import annotations

import json

from qarl.report import read_metrics
from qarl.train.trainer import train


def _write_dataset(path):
    good = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10) for b in (1, 2)]
    lines = [json.dumps(row) for row in good]
    lines += [
        json.dumps({"prompt": "What is 1 + 1?"}),  # missing answer
        json.dumps({"prompt": "  ", "answer": "2"}),  # empty prompt
        json.dumps({"prompt": 5, "answer": "2"}),  # wrong type
        json.dumps({"prompt": "What is " + "1 + " * 200 + "1?", "answer": "201"}),  # too long
        "{not json",  # unparseable
    ]
    path.write_text("\n".join(lines) + "\n")


def test_bad_rows_and_failing_rewards_are_counted_and_the_run_finishes(tmp_path):
    """A dataset with every kind of bad row trains on its good rows and reports the bad ones
    per reason; a reward that raises or hangs yields counted error/timeout outcomes (reward
    None, never 0) and the run still completes every step."""
    data = tmp_path / "data.jsonl"
    _write_dataset(data)
    summary = train("tiny", {
        "run.output_dir": str(tmp_path / "runs"), "log.progress": False, "log.plot": False,
        "task.name": None, "task.dataset": str(data), "task.reward": "flaky_reward:reward",
        "task.options": {"eval_fraction": 0.3, "max_prompt_len": 200},
        "task.reward_timeout_s": 0.3, "task.eval_size": 8, "sft.steps": 0,
        "train.steps": 2, "rollout.batch_size": 16, "rollout.group_size": 4,
        "train.micro_batch_size": 16,
        "eval.full_precision": False,
    })
    run_dir = tmp_path / "runs" / "tiny"
    report = (run_dir / "dataset_report.txt").read_text()
    for reason in ("missing_answer=1", "empty_prompt=1", "wrong_type=1", "too_long=1"):
        assert reason in report, report
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rows) == 2
    outcomes = {k: sum(r[f"reward/{k}"] for r in rows) for k in ("ok", "error", "timeout")}
    assert outcomes["ok"] > 0 and outcomes["error"] > 0 and outcomes["timeout"] > 0, outcomes
    assert summary["after"] is not None
