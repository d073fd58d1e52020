"""Running the arm/seed runs of `qarl compare` as `qarl train` subprocesses.

Each run is `python -m qarl.cli train RECIPE <overrides> <arm's overrides> --run.seed=K
--run.output_dir=FOLDER/ARM --run.name=seedK`, so its folder is exactly what `qarl train`
writes, and a killed run resumes from its checkpoint when started again (run.resume). A run
with a summary.json is finished and not started again. With `jobs` runs at once, each gets
cores // jobs threads (OMP_NUM_THREADS, which torch and the native kernels follow).
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


def train_command(plan: ArmPlan, run: ArmRun) -> list[str]:
    """The `qarl train` command line of one run: the arm's overrides, the command line's,
    then the run's seed and folder."""
    overrides = {**plan.arm_overrides[run.arm], **plan.overrides,
                 "run.seed": run.seed, "run.output_dir": str(run.folder.parent),
                 "run.name": run.folder.name}
    return [sys.executable, "-m", "qarl.cli", "train", str(plan.recipe),
            *(f"--{key}={toml_value(value)}" for key, value in overrides.items())]


def thread_env(jobs: int) -> dict[str, str]:
    """The environment of a run when `jobs` run at once: the cores split evenly, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(max(1, (cores or 1) // jobs))
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(empty log)"


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_all(plan: ArmPlan, runs: list[ArmRun], jobs: int) -> list[ArmRun]:
    """Run every unfinished run, `jobs` at a time, with one progress bar (on stderr) over all
    their training steps and a line per finished or failed run. Returns the failed runs.

    Interrupted (Ctrl-C, or SIGTERM, which is turned into the same KeyboardInterrupt), it
    stops the runs it started before raising, so none is left running without it."""
    from tqdm import tqdm

    out = sys.stderr
    pending = [run for run in runs if not run.finished()]
    for run in runs:
        if run not in pending:
            print(f"{run.name}: finished before, not run again ({run.folder})", file=out)
    env = thread_env(jobs)
    bar = tqdm(total=sum(run.steps for run in runs), desc="compare", unit="step", file=out,
               dynamic_ncols=True)
    running: dict[subprocess.Popen, tuple[ArmRun, float, IO]] = {}
    failed: list[ArmRun] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                run = pending.pop(0)
                run.folder.parent.mkdir(parents=True, exist_ok=True)
                log = run.log.open("a")
                process = subprocess.Popen(train_command(plan, run), stdout=log,
                                           stderr=subprocess.STDOUT, env=env)
                running[process] = (run, time.monotonic(), log)
            time.sleep(POLL_S)
            for process in [p for p in running if p.poll() is not None]:
                run, started, log = running.pop(process)
                log.close()
                seconds = time.monotonic() - started
                if process.returncode == 0:
                    bar.write(f"{run.name}: done in {seconds:.0f} s ({run.folder})", file=out)
                else:
                    failed.append(run)
                    bar.write(f"{run.name}: FAILED (exit status {process.returncode}) after "
                              f"{seconds:.0f} s: {_last_line(run.log)}; log: {run.log}",
                              file=out)
            done = sum(run.steps if run.finished() else run.steps_done() for run in runs)
            if done != bar.n:
                bar.update(done - bar.n)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for process, (run, _, log) in running.items():  # interrupted: stop our own children
            process.terminate()
            process.wait()
            log.close()
        bar.close()
    return failed
