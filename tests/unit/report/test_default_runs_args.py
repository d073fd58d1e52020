"""benchmarks/default_runs.py refuses, before any run starts, a --keep folder that holds a run
of a requested seed: `qarl train` would resume it (a finished one at once) and the table would
report the old run's accuracies with the resume's wall time and memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "default_runs.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_a_kept_folder_with_a_seeds_run_is_refused(tmp_path):
    (tmp_path / "seed1").mkdir()
    done = _run("--keep", str(tmp_path), "--seeds", "0", "1")
    assert done.returncode == 2
    assert f"--keep {tmp_path} already holds seed1" in done.stderr
    assert f"--from {tmp_path}" in done.stderr  # the fix: read the kept runs instead
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seed1"]  # nothing started


def test_results_with_overrides_is_refused():
    done = _run("--results", "--train.steps=2")
    assert done.returncode == 2 and "drop the overrides" in done.stderr
