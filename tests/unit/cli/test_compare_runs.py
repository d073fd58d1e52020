"""How `qarl compare` starts its runs: the `qarl train` command of each, threads per run,
progress read from metrics files."""

from __future__ import annotations

import json
import os
import sys

import pytest

from qarl.cli.compare_runs import ArmRun, plan_runs, thread_env, train_command
from qarl.config import load_arms, load_config, parse_overrides


def test_train_command_gives_the_arm_config(tmp_path):
    """Each run's command line, read back as `qarl train` reads it, is the arm's config with
    the run's seed and folder FOLDER/ARM/seedK (command-line overrides after the arm's)."""
    plan = load_arms("tiny", ["--train.steps=2", f"--run.output_dir={tmp_path}",
                              "--compare.seeds=[3, 4]"], arms=["naive", "fp"])
    runs = plan_runs(plan)
    assert [(r.arm, r.seed, r.steps) for r in runs] == [
        ("naive", 3, 2), ("naive", 4, 2), ("fp", 3, 2), ("fp", 4, 2)]
    assert runs[1].folder == tmp_path / "tiny" / "naive" / "seed4"
    assert runs[1].log == tmp_path / "tiny" / "naive" / "seed4.log"
    command = train_command(plan, runs[1])
    assert command[1:5] == ["-m", "qarl.cli", "train", str(plan.recipe)]
    config = load_config(command[4], parse_overrides(command[5:]))
    assert config.run.seed == 4 and config.run.name == "seed4"
    assert config.run.output_dir == str(tmp_path / "tiny" / "naive")
    assert config.model_copy(update={"run": plan.configs["naive"].run}) == plan.configs["naive"]
    assert config.quant.align == "naive" and config.train.steps == 2


def test_threads_are_split_between_jobs():
    """N runs at once get cores // N threads each, never 0."""
    cores = len(os.sched_getaffinity(0))
    assert thread_env(1)["OMP_NUM_THREADS"] == str(cores)
    assert thread_env(cores)["OMP_NUM_THREADS"] == "1"
    assert thread_env(cores + 5)["MKL_NUM_THREADS"] == "1"


def test_steps_done_counts_complete_training_rows(tmp_path):
    """Progress counts the training rows of metrics.jsonl; eval rows and a line still being
    written do not count; a run with summary.json is finished."""
    run = ArmRun("a", 0, tmp_path / "a" / "seed0", steps=5)
    assert run.steps_done() == 0 and not run.finished()
    run.folder.mkdir(parents=True)
    rows = [{"step": 0, "kind": "eval"}, {"step": 1, "kind": "train"},
            {"step": 2, "kind": "train"}]
    (run.folder / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "ki')
    assert run.steps_done() == 2
    (run.folder / "summary.json").write_text("{}")
    assert run.finished()


def test_sigterm_stops_the_runs_it_started(tmp_path, monkeypatch):
    """SIGTERM to compare becomes a KeyboardInterrupt after its running children are stopped,
    so no run is left going on without it (a later compare resumes them)."""
    import signal
    import subprocess
    import threading

    import qarl.cli.compare_runs as compare_runs

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(compare_runs, "train_command",
                        lambda plan, run: [sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(compare_runs.subprocess, "Popen", popen)
    plan = load_arms("tiny", [f"--run.output_dir={tmp_path}"], arms=["naive", "qarl"])
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        compare_runs.run_all(plan, plan_runs(plan), jobs=2)
    assert len(started) == 2 and all(p.poll() is not None for p in started)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
