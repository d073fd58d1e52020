"""Running the arm/seed runs of `qarl compare` as `qarl train` subprocesses.

Each run is `python -m qarl.cli train RECIPE <overrides> <arm's overrides> --run.seed=K
--run.output_dir=FOLDER/ARM --run.name=seedK --eval.cache_dir=FOLDER/eval-cache`, so its
folder is exactly what `qarl train` writes (and evaluations the runs share are run once), and a killed run resumes from its checkpoint when started again (run.resume). A run
with a summary.json is finished and not started again. With `jobs` runs at once, each gets
cores // jobs threads (OMP_NUM_THREADS, which torch and the native kernels follow).

Before any run starts, the warm starts (`[sft]`) the unfinished runs share and the cache lacks
are trained by `qarl sft`, as many at once as there are jobs and no more, so a recipe with one
shared warm start trains it with every core instead of in the first run, on its share of the
cores, while the other runs wait on the cache lock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from qarl.config import ArmPlan
from qarl.config.toml_out import toml_value
from qarl.native.isa import usable_cores

POLL_S = 0.5  # how often running runs are checked and the progress bar updated


@dataclass
class ArmRun:
    """One arm/seed run of the plan."""

    arm: str
    seed: int
    folder: Path  # the run folder FOLDER/ARM/seedK
    steps: int  # train.steps of the arm

    @property
    def name(self) -> str:
        return f"{self.arm}/seed{self.seed}"

    @property
    def log(self) -> Path:  # next to the run folder, so the run folder is what `qarl train` writes
        return self.folder.with_name(f"{self.folder.name}.log")

    def finished(self) -> bool:
        return (self.folder / "summary.json").exists()

    def steps_done(self) -> int:
        """Training steps in the run's metrics.jsonl (a line being written is not counted)."""
        path = self.folder / "metrics.jsonl"
        if not path.exists():
            return 0
        done = 0
        for line in path.read_text().splitlines(keepends=True):
            if line.endswith("\n") and line.strip():
                done += json.loads(line).get("kind") == "train"
        return done


def plan_runs(plan: ArmPlan) -> list[ArmRun]:
    return [ArmRun(arm, seed, plan.run_dir(arm, seed), config.train.steps)
            for arm, config in plan.configs.items() for seed in plan.seeds]


def qarl_command(verb: str, plan: ArmPlan, arm: str, overrides: dict) -> list[str]:
    """`python -m qarl.cli VERB RECIPE` with the arm's overrides, the command line's, then
    `overrides`."""
    merged = {**plan.arm_overrides[arm], **plan.overrides, **overrides}
    return [sys.executable, "-m", "qarl.cli", verb, str(plan.recipe),
            *(f"--{key}={toml_value(value)}" for key, value in merged.items())]


def train_command(plan: ArmPlan, run: ArmRun) -> list[str]:
    """The `qarl train` command line of one run: the arm's overrides, the command line's,
    then the run's seed and folder, and (unless the recipe names one) the comparison's
    eval.cache_dir, FOLDER/eval-cache: runs that evaluate one policy the same way (step 0 of
    the arms that share a warm start and engine) evaluate it once."""
    shared = {} if plan.configs[run.arm].eval.cache_dir else {
        "eval.cache_dir": str(plan.folder / "eval-cache")}
    return qarl_command("train", plan, run.arm, {
        "run.seed": run.seed, "run.output_dir": str(run.folder.parent),
        "run.name": run.folder.name, **shared})


@dataclass
class WarmStart:
    """One warm-start SFT (`[sft]`) that unfinished runs share and the cache lacks."""

    key: str  # its entry under $QARL_HOME/sft (qarl.train.sft.sft_key)
    command: list[str]  # `qarl sft` for the first run that needs it
    log: Path  # FOLDER/warm-start-KEY.log
    runs: list[ArmRun]  # the runs that start from it

    @property
    def name(self) -> str:
        return f"warm start {self.key}"


def warm_starts(plan: ArmPlan, runs: list[ArmRun]) -> list[WarmStart]:
    """The warm starts `runs` need that are not cached yet, in the order the runs come, one
    per cache entry: a recipe with sft.seed set shares one across all its seeds and arms."""
    from qarl.train.sft import sft_folder

    needed: dict[str, WarmStart] = {}
    for run in runs:
        config = plan.configs[run.arm]
        if config.sft.steps == 0:
            continue
        folder = sft_folder(config.model_copy(
            update={"run": config.run.model_copy(update={"seed": run.seed})}))
        if (folder / "model.safetensors").exists():
            continue
        key = folder.name
        if key not in needed:
            needed[key] = WarmStart(key, qarl_command("sft", plan, run.arm, {"run.seed": run.seed}),
                                    plan.folder / f"warm-start-{key}.log", [])
        needed[key].runs.append(run)
    return list(needed.values())


class WarmStartFailed(Exception):
    """A warm start the runs need ended with an error: no run was started."""


def thread_env(jobs: int) -> dict[str, str]:
    """The environment of a run when `jobs` run at once: the cores split evenly, at least 1."""
    threads = str(max(1, usable_cores() // jobs))
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(empty log)"


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _pool(jobs: list, at_once: int, start, finish, tick=lambda: None) -> None:
    """Run every job, `at_once` at a time: `start(job)` returns its process, `finish(job,
    process, seconds)` is called as each ends, `tick()` after every poll. However it ends
    (KeyboardInterrupt included), no process it started is left running: all are sent
    SIGTERM first, then waited for, so a run waiting on another (a shared warm start's lock)
    is not waited for before the other is told to stop."""
    pending, running = list(jobs), {}
    try:
        while pending or running:
            while pending and len(running) < at_once:
                job = pending.pop(0)
                running[start(job)] = (job, time.monotonic())
            time.sleep(POLL_S)
            for process in [p for p in running if p.poll() is not None]:
                job, started = running.pop(process)
                finish(job, process, time.monotonic() - started)
            tick()
    finally:
        for process in running:
            process.terminate()
        for process in running:
            process.wait()


def _launch(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start `command` with stdout and stderr appended to `log` (the child keeps its own
    handle on the file)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)


def prepare_warm_starts(plan: ArmPlan, runs: list[ArmRun], jobs: int, out: IO) -> None:
    """Train the warm starts the runs share before any run starts, each with its share of
    every core (one warm start alone gets them all) rather than inside the first run that
    needs it, with a run's share of the cores, while the runs waiting on it hold the rest
    idle. Raises WarmStartFailed, naming each failure and its log."""
    needed = warm_starts(plan, runs)
    failures: list[str] = []

    def start(warm: WarmStart) -> subprocess.Popen:
        print(f"{warm.name} (for {len(warm.runs)} runs): training; log: {warm.log}", file=out)
        return _launch(warm.command, warm.log, thread_env(min(jobs, len(needed))))

    def finish(warm: WarmStart, process: subprocess.Popen, seconds: float) -> None:
        if process.returncode == 0:
            print(f"{warm.name}: done in {seconds:.0f} s", file=out)
        else:
            failures.append(f"{warm.name} FAILED (exit status {process.returncode}) after "
                            f"{seconds:.0f} s: {_last_line(warm.log)}; log: {warm.log}")
            print(failures[-1], file=out)

    _pool(needed, jobs, start, finish)
    if failures:
        raise WarmStartFailed("; ".join(failures))


def run_all(plan: ArmPlan, runs: list[ArmRun], jobs: int) -> list[ArmRun]:
    """Prepare the warm starts the unfinished runs share (`prepare_warm_starts`), then run
    every unfinished run, `jobs` at a time, with one progress bar (on stderr) over all their
    training steps and a line per finished or failed run. Returns the failed runs.

    Interrupted (Ctrl-C, or SIGTERM, which is turned into the same KeyboardInterrupt), it
    stops the processes it started before raising, so none is left running without it."""
    from tqdm import tqdm

    out = sys.stderr
    pending = [run for run in runs if not run.finished()]
    for run in runs:
        if run not in pending:
            print(f"{run.name}: finished before, not run again ({run.folder})", file=out)
    failed: list[ArmRun] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        prepare_warm_starts(plan, pending, jobs, out)
        env = thread_env(jobs)
        with tqdm(total=sum(run.steps for run in runs), desc="compare", unit="step", file=out,
                  dynamic_ncols=True) as bar:

            def finish(run: ArmRun, process: subprocess.Popen, seconds: float) -> None:
                if process.returncode == 0:
                    bar.write(f"{run.name}: done in {seconds:.0f} s ({run.folder})", file=out)
                else:
                    failed.append(run)
                    bar.write(f"{run.name}: FAILED (exit status {process.returncode}) after "
                              f"{seconds:.0f} s: {_last_line(run.log)}; log: {run.log}",
                              file=out)

            def tick() -> None:
                done = sum(run.steps if run.finished() else run.steps_done() for run in runs)
                if done != bar.n:
                    bar.update(done - bar.n)

            _pool(pending, jobs,
                  lambda run: _launch(train_command(plan, run), run.log, env), finish, tick)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return failed
