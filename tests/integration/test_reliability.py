"""A run survives being killed, stopped, bad numbers and bad reward code (docs/training.md,
"Reliability"). The `tiny` recipe, 4 small steps; runs that get signals are subprocesses
(tests/integration/run_qarl.py), and every interrupted run, resumed, ends exactly where an
uninterrupted one does."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import qarl.train.trainer as trainer
from qarl.algo import LOSSES
from qarl.config import load_config
from qarl.report import read_metrics
from qarl.tasks import make_task
from qarl.train import checkpoint
from qarl.train.guards import TrainingAborted
from qarl.train.phases import train_examples
from qarl.train.trainer import train

HERE = Path(__file__).resolve().parent
STEPS = 4
SMALL = {"train.steps": STEPS, "rollout.batch_size": 8, "train.micro_batch_size": 8,
         "eval.size": 8, "eval.full_precision": False, "log.plot": False,
         "task.reward": "reliability_rewards:slow", "train.checkpoint_every": 0,
         "monitor.window": 1}  # monitors from step 2: a resume must keep their history
# metrics that differ between identical runs
TIMING = ("time/", "speed/", "sync/seconds", "contract/seconds")


def _args(out: Path, **extra) -> list[str]:
    return ["train", "tiny", f"--run.output_dir={out}",
            *(f"--{k}={str(v).lower() if isinstance(v, bool) else v}"
              for k, v in {**SMALL, **extra}.items())]


def _start(args: list[str], logs: Path, **env) -> subprocess.Popen:
    """Run qarl ARGS; its stderr goes to a file in `logs` (a pipe nobody reads could fill
    and block it), readable as `child.log.read_text()`."""
    log = logs / f"stderr_{time.monotonic_ns()}.txt"
    with log.open("w") as sink:
        child = subprocess.Popen([sys.executable, str(HERE / "run_qarl.py"), *args],
                                 env={**os.environ, **env}, stderr=sink)
    child.log = log
    return child


def _finish(args: list[str], logs: Path, **env) -> None:
    child = _start(args, logs, **env)
    child.wait(timeout=600)
    assert child.returncode == 0, child.log.read_text()


def _wait_for(predicate, child: subprocess.Popen, what: str, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert child.poll() is None, f"the run ended before {what}: {child.log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} within {limit_s} s"
        time.sleep(0.02)


def _stop(child: subprocess.Popen, signum: int) -> float:
    """Send `signum`; return the seconds the run took to exit."""
    start = time.monotonic()
    child.send_signal(signum)
    child.wait(timeout=60)
    return time.monotonic() - start


def _outcome(run_dir: Path) -> tuple[dict, list[dict]]:
    """Final weights, and every metrics row without its timings."""
    weights = load_file(checkpoint.latest(run_dir) / "model.safetensors")
    rows = [{k: v for k, v in row.items() if not k.startswith(TIMING)}
            for row in read_metrics(run_dir / "metrics.jsonl")]
    return weights, rows


def _assert_same_run(run_dir: Path, reference: tuple[dict, list[dict]]) -> None:
    weights, rows = _outcome(run_dir)
    assert weights.keys() == reference[0].keys()
    assert all(torch.equal(weights[k], reference[0][k]) for k in weights)
    assert [(r["kind"], r["step"]) for r in rows] == [(r["kind"], r["step"]) for r in reference[1]]
    assert rows == reference[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every interrupted one is compared with."""
    out = tmp_path_factory.mktemp("reference")
    _finish(_args(out), out)
    return _outcome(out / "tiny")


def test_sigkill_after_a_checkpoint_then_resume_equals_the_uninterrupted_run(tmp_path, reference):
    """Killed with SIGKILL at a random moment after its step-2 checkpoint, then resumed with
    `qarl train --resume`: the final weights are torch.equal to the uninterrupted run's and
    the metrics rows (timings aside) are the same rows, none duplicated."""
    delay = random.uniform(0.0, 1.5)
    child = _start(_args(tmp_path, **{"train.checkpoint_every": 2}), tmp_path)
    run_dir = tmp_path / "tiny"
    _wait_for(lambda: (run_dir / "latest").exists(), child, "the step-2 checkpoint")
    time.sleep(delay)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    _finish(["train", "--resume", str(run_dir)], tmp_path)
    _assert_same_run(run_dir, reference)


def test_sigterm_in_generation_and_in_rewards_then_resume(tmp_path, reference):
    """SIGTERM in the middle of step 3's generation: exit 143 within a few seconds, leaving a
    complete checkpoint of the 2 finished steps (checkpoint_every = 0: the stop saved it).
    Resumed, SIGTERM while a reward hangs in the redone step 3: exit 143 again within a few
    seconds. Resumed again, the run ends exactly as the uninterrupted one."""
    run_dir, marker = tmp_path / "tiny", tmp_path / "in_generation"
    child = _start(_args(tmp_path), tmp_path, QARL_TEST_SLOW_DECODE=f"2:{marker}")
    _wait_for(marker.exists, child, "step 3's generation")
    seconds = _stop(child, signal.SIGTERM)
    assert child.returncode == 143 and seconds < 5, (child.returncode, seconds)
    assert f"continue with: qarl train --resume {run_dir}" in child.log.read_text()
    assert checkpoint.latest(run_dir).name == "step_000002"
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"] == [1, 2]

    marker = tmp_path / "in_reward"
    child = _start(["train", "--resume", str(run_dir)], tmp_path,
                   QARL_TEST_SLOW_REWARD=str(marker))
    _wait_for(marker.exists, child, "a reward call of step 3")
    seconds = _stop(child, signal.SIGTERM)
    assert child.returncode == 143 and seconds < 5, (child.returncode, seconds)
    assert checkpoint.latest(run_dir).name == "step_000002"

    _finish(["train", "--resume", str(run_dir)], tmp_path)
    _assert_same_run(run_dir, reference)


def _in_process(tmp_path, **extra):
    return {**SMALL, "run.output_dir": str(tmp_path), "task.reward": None,
            "rollout.batch_size": 16, "train.micro_batch_size": 16,
            "train.checkpoint_every": 1, "train.keep_checkpoints": STEPS, **extra}


def _plant_nan(monkeypatch, steps: set[int]) -> None:
    """The loss is NaN in the given (0-based) steps."""
    current = {}
    real_step, real_loss = trainer.rl_step, LOSSES["tbpo"]

    def rl_step(policy, data, config, step):
        current["step"] = step
        return real_step(policy, data, config, step)

    @functools.wraps(real_loss)  # the loss registry reads its keyword parameters
    def loss(*args, **kwargs):
        value, metrics = real_loss(*args, **kwargs)
        return (value * float("nan") if current["step"] in steps else value), metrics

    monkeypatch.setattr(trainer, "rl_step", rl_step)
    monkeypatch.setitem(LOSSES, "tbpo", loss)


def _step_files(run_dir: Path, step: int) -> dict:
    folder = run_dir / f"step_{step:06d}"
    return {**load_file(folder / "model.safetensors"),
            **{f"opt.{k}": v for k, v in load_file(folder / "optimizer.safetensors").items()}}


def test_a_nan_loss_skips_its_step_and_the_run_goes_on(tmp_path, monkeypatch):
    """A NaN loss planted in step 2: that step is counted (guard/nonfinite) and leaves the
    weights and optimizer state of step 1 bit for bit; the steps after it train on."""
    _plant_nan(monkeypatch, {1})
    train("tiny", _in_process(tmp_path))
    run_dir = tmp_path / "tiny"
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["guard/nonfinite"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    one, two, four = (_step_files(run_dir, s) for s in (1, 2, 4))
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert any(not torch.equal(two[k], four[k]) for k in two)


def test_bad_steps_in_a_row_abort_with_a_message(tmp_path, monkeypatch):
    """NaN in every step with train.max_bad_steps = 2: step 1's samples have no reward spread
    (no loss is computed: a no-op, not a bad step), so steps 2 and 3 are two bad steps in a
    row and the run aborts at step 3 with a message saying what to check; the checkpoint of
    step 2 (weights unchanged since step 1) is intact."""
    _plant_nan(monkeypatch, set(range(STEPS)))
    with pytest.raises(TrainingAborted, match=r"2 steps in a row \(steps 2-3\).*train.lr"):
        train("tiny", _in_process(tmp_path, **{"train.max_bad_steps": 2}))
    assert checkpoint.latest(tmp_path / "tiny").name == "step_000002"


def test_out_of_memory_stops_with_the_settings_to_lower(tmp_path, monkeypatch):
    """Out of memory in step 3 ends the run with a message naming the batch settings; the
    checkpoint of step 2 is intact and latest."""
    real = trainer.rl_step

    def rl_step(policy, data, config, step):
        if step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(policy, data, config, step)

    monkeypatch.setattr(trainer, "rl_step", rl_step)
    with pytest.raises(TrainingAborted, match="out of memory in step 3 of 4.*micro_batch_size"):
        train("tiny", _in_process(tmp_path))
    assert checkpoint.latest(tmp_path / "tiny").name == "step_000002"


def test_no_signal_steps_are_no_ops(tmp_path):
    """A reward that can score nothing (always None): every group is all-unscorable, every
    advantage 0, each step a counted no-op (guard/no_signal) that leaves the weights as they
    were."""
    train("tiny", _in_process(tmp_path, **{"task.reward": "reliability_rewards:unscorable",
                                           "train.steps": 2}))
    run_dir = tmp_path / "tiny"
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["guard/no_signal"], r["reward/unscorable"]) for r in rows] == [(1.0, 1.0)] * 2
    one, two = _step_files(run_dir, 1), _step_files(run_dir, 2)
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_rewards_that_hang_raise_exit_or_return_junk_are_counted(tmp_path):
    """With a reward that, by the gold answer, sleeps past its deadline, raises, calls
    os._exit, returns a string or scores: the run finishes and each step's outcome counts
    (and workers replaced: one per hang or exit) are exactly those the answers call for (2
    samples per prompt; seed 0 reaches every behaviour in 3 steps; its 4 held-out sums hold
    one the reward scores, so the run's first batch is not all failures). Each distinct
    failure is kept once in reward_errors.txt, and every JSON file the run wrote is JSON."""
    from reliability_rewards import BEHAVIOURS

    config = load_config("tiny", _in_process(tmp_path, **{
        "task.reward": "reliability_rewards:misbehaving", "task.reward_timeout_s": 0.5,
        "task.reward_workers": 2, "train.steps": 3, "rollout.group_size": 2,
        "rollout.batch_size": 8, "train.micro_batch_size": 8, "eval.size": 4}))
    task = make_task(config.task.name, **config.task.options)
    expected, seen = [], set()
    for step in range(config.train.steps):
        answers = [ex.answer for ex in train_examples(task, config.run.seed, step, 4)]
        kinds = [BEHAVIOURS[int(a) % 5] for a in answers]
        seen.update(kinds)
        expected.append({"timeout": kinds.count("hang") / 4,
                         "error": sum(kinds.count(k) for k in ("raise", "exit", "string")) / 4,
                         "ok": kinds.count("ok") / 4,
                         "workers_replaced": (kinds.count("hang") + kinds.count("exit")) * 2})
    assert seen == set(BEHAVIOURS), f"seed {config.run.seed} does not reach every behaviour"
    train(config)
    rows = [r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if r["kind"] == "train"]
    assert [{k: r[f"reward/{k}"] for k in expected[0]} for r in rows] == expected
    # every JSON file the run wrote is JSON (null, never NaN, where no reward scored)
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    for path in [tmp_path / "tiny" / "summary.json", tmp_path / "tiny" / "contract.json"]:
        json.loads(path.read_text(), parse_constant=refuse)
    for line in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)
    # each distinct failure kept once, with where it first happened
    errors = (tmp_path / "tiny" / "reward_errors.txt").read_text().splitlines()
    messages = [line.split(": ", 1)[1] for line in errors]
    assert len(messages) == len(set(messages))
    assert any(m.startswith("ValueError: a planted reward failure (at ") and
               "reliability_rewards.py" in m for m in messages)
    assert any("no answer within 0.5 s" in m for m in messages)
    assert any("reward worker died (exit code 3)" in m for m in messages)


def test_a_batched_reward_that_raises_or_hangs_is_counted_per_sample(tmp_path, monkeypatch):
    """task.reward_batch: the batch call that raises makes every sample of its step an error,
    the one that hangs every sample a timeout (its worker replaced once), with the message
    kept once; the other steps score every sample, and the run finishes."""
    calls = tmp_path / "calls"
    calls.mkdir()
    monkeypatch.setenv("QARL_TEST_BATCH_CALLS", str(calls))
    config = load_config("tiny", _in_process(tmp_path, **{
        "task.reward": "reliability_rewards:batched", "task.reward_batch": True,
        "task.reward_timeout_s": 1.0, "train.steps": 3, "eval.size": 4}))
    train(config)
    rows = [r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if r["kind"] == "train"]
    outcomes = [{k: r[f"reward/{k}"] for k in ("ok", "error", "timeout", "workers_replaced")}
                for r in rows]
    assert outcomes == [{"ok": 0.0, "error": 1.0, "timeout": 0.0, "workers_replaced": 0.0},
                        {"ok": 0.0, "error": 0.0, "timeout": 1.0, "workers_replaced": 1.0},
                        {"ok": 1.0, "error": 0.0, "timeout": 0.0, "workers_replaced": 0.0}]
    assert len(list(calls.iterdir())) == 5  # evaluation, 3 steps, evaluation: one call each
    errors = (tmp_path / "tiny" / "reward_errors.txt").read_text().splitlines()
    assert len(errors) == 2
    assert "ValueError: a planted batch failure" in errors[0]
    assert "no answer within 1.0 s" in errors[1]
