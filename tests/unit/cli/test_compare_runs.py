"""How `qarl compare` starts its runs: the warm starts they share first, the `qarl train`
command of each, threads per run, progress read from metrics files, stopping on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

import qarl.cli.compare_runs as compare_runs
from qarl.cli.compare_runs import ArmRun, plan_runs, thread_env, train_command
from qarl.config import load_arms, load_config, parse_overrides


def test_train_command_gives_the_arm_config(tmp_path):
    """Each run's command line, read back as `qarl train` reads it, is the arm's config with
    the run's seed and folder FOLDER/ARM/seedK (command-line overrides after the arm's) and
    the comparison's shared eval cache FOLDER/eval-cache, unless the recipe names one."""
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
    assert config.eval.cache_dir == str(tmp_path / "tiny" / "eval-cache")
    same = {"run": plan.configs["naive"].run, "eval": plan.configs["naive"].eval}
    assert config.model_copy(update=same) == plan.configs["naive"]
    assert config.quant.align == "naive" and config.train.steps == 2
    own = load_arms("tiny", [f"--run.output_dir={tmp_path}", "--eval.cache_dir=/elsewhere"])
    command = train_command(own, plan_runs(own)[0])
    assert load_config(command[4], parse_overrides(command[5:])).eval.cache_dir == "/elsewhere"


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


class _Recorded(subprocess.Popen):
    """A Popen that records when compare stops it."""

    events: list[tuple[str, int]] = []

    def terminate(self):
        self.events.append(("terminate", self.pid))
        super().terminate()

    def wait(self, timeout=None):
        self.events.append(("wait", self.pid))
        return super().wait(timeout)


def _sleeper(seconds: float = 60) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds})"]


def _sigterm_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


@pytest.fixture
def recorded_popen(monkeypatch):
    """Every process compare starts, as a _Recorded; the list of them."""
    started: list[subprocess.Popen] = []
    _Recorded.events = []

    def popen(*args, **kwargs):
        started.append(_Recorded(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(compare_runs.subprocess, "Popen", popen)
    return started


def test_sigterm_stops_the_runs_it_started(tmp_path, monkeypatch, recorded_popen):
    """SIGTERM to compare becomes a KeyboardInterrupt after its running children are stopped,
    so no run is left going on without it (a later compare resumes them). All are told to
    stop before any is waited for: a run waiting on another's warm start ends its wait when
    told, and must not hold up the stop of the run it waits on."""
    monkeypatch.setattr(compare_runs, "train_command", lambda plan, run: _sleeper())
    monkeypatch.setattr(compare_runs, "warm_starts", lambda plan, runs: [])
    plan = load_arms("tiny", [f"--run.output_dir={tmp_path}"], arms=["naive", "qarl"])
    _sigterm_after(1.0)
    with pytest.raises(KeyboardInterrupt):
        compare_runs.run_all(plan, plan_runs(plan), jobs=2)
    assert len(recorded_popen) == 2 and all(p.poll() is not None for p in recorded_popen)
    stops = [kind for kind, _ in _Recorded.events]
    assert stops[:2] == ["terminate", "terminate"] and stops[2:4] == ["wait", "wait"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_warm_starts_one_per_cache_entry(tmp_path, qarl_home):
    """The warm starts unfinished runs need: one per cache entry (the tiny recipe's follows
    run.seed, so one per seed, shared by the arms; with sft.seed set, one for all), none for
    an entry already cached; each command, read back as `qarl sft` reads it, trains exactly
    the entry the runs will look up."""
    from qarl.train.sft import sft_key

    plan = load_arms("tiny", [f"--run.output_dir={tmp_path}", "--compare.seeds=[3, 4]"],
                     arms=["naive", "fp"])
    runs = plan_runs(plan)
    needed = compare_runs.warm_starts(plan, runs)
    assert [[r.name for r in w.runs] for w in needed] == [
        ["naive/seed3", "fp/seed3"], ["naive/seed4", "fp/seed4"]]
    for warm, seed in zip(needed, [3, 4]):
        assert warm.command[1:5] == ["-m", "qarl.cli", "sft", str(plan.recipe)]
        config = load_config(warm.command[4], parse_overrides(warm.command[5:]))
        assert config.run.seed == seed and sft_key(config) == warm.key
        assert warm.log == tmp_path / "tiny" / f"warm-start-{warm.key}.log"
    cached = qarl_home / "sft" / needed[0].key
    cached.mkdir(parents=True)
    (cached / "model.safetensors").write_bytes(b"")
    assert [w.key for w in compare_runs.warm_starts(plan, runs)] == [needed[1].key]
    assert compare_runs.warm_starts(plan, runs[::2]) == []  # only the seed-3 runs left

    shared = load_arms("tiny", [f"--run.output_dir={tmp_path}", "--compare.seeds=[3, 4]",
                                "--sft.seed=9"], arms=["naive", "fp"])
    (one,) = compare_runs.warm_starts(shared, plan_runs(shared))
    assert len(one.runs) == 4
    none = load_arms("tiny", [f"--run.output_dir={tmp_path}", "--sft.steps=0"])
    assert compare_runs.warm_starts(none, plan_runs(none)) == []


def _one_warm_start(plan, runs, command):
    return [compare_runs.WarmStart("k", command, plan.folder / "warm-start-k.log", list(runs))]


def test_runs_start_after_their_warm_start(tmp_path, monkeypatch, recorded_popen):
    """A warm start is trained before any run starts, with every core when it is the only
    one; a failed warm start starts no run and names its log; SIGTERM during it stops it."""
    plan = load_arms("tiny", [f"--run.output_dir={tmp_path}", "--compare.seeds=[0]"],
                     arms=["naive", "qarl"])
    runs = plan_runs(plan)
    monkeypatch.setattr(compare_runs, "train_command", lambda plan, run: _sleeper(0))
    monkeypatch.setattr(compare_runs, "warm_starts", lambda plan, runs: _one_warm_start(
        plan, runs, [sys.executable, "-c", "import os; print('threads', os.environ['OMP_NUM_THREADS'])"]))
    assert compare_runs.run_all(plan, runs, jobs=2) == []
    assert len(recorded_popen) == 3 and recorded_popen[0].args[-1].startswith("import os")
    cores = len(os.sched_getaffinity(0))
    assert (plan.folder / "warm-start-k.log").read_text() == f"threads {cores}\n"

    recorded_popen.clear()
    monkeypatch.setattr(compare_runs, "warm_starts", lambda plan, runs: _one_warm_start(
        plan, runs, [sys.executable, "-c", "print('no data'); raise SystemExit(3)"]))
    with pytest.raises(compare_runs.WarmStartFailed,
                       match=r"exit status 3.*no data; log: .*warm-start-k.log"):
        compare_runs.run_all(plan, runs, jobs=2)
    assert len(recorded_popen) == 1  # the warm start, no run

    recorded_popen.clear()
    monkeypatch.setattr(compare_runs, "warm_starts",
                        lambda plan, runs: _one_warm_start(plan, runs, _sleeper()))
    _sigterm_after(1.0)
    with pytest.raises(KeyboardInterrupt):
        compare_runs.run_all(plan, runs, jobs=2)
    assert len(recorded_popen) == 1 and recorded_popen[0].poll() is not None


def test_held_out_seeds_run_after_the_others_and_are_named(tmp_path, monkeypatch, capsys):
    """`qarl compare` runs compare.held_out_seeds after compare.seeds for every arm and says
    which seeds are held out before it starts."""
    from qarl.cli import main

    started = []
    monkeypatch.setattr(compare_runs, "run_all",
                        lambda plan, runs, jobs: started.extend(runs) or list(runs))
    assert main(["compare", "claim_quick", "--arms", "fp-grpo,kernel-tbpo",
                 f"--run.output_dir={tmp_path}"]) == 1  # every run "failed": no report
    assert [(run.arm, run.seed) for run in started] == [
        ("fp-grpo", 0), ("fp-grpo", 1), ("kernel-tbpo", 0), ("kernel-tbpo", 1)]
    assert "4 runs (2 arms x seeds [0] and held-out [1])" in capsys.readouterr().err
