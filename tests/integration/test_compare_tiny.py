"""`qarl compare` end to end on the tiny recipe: two arms, one seed, two steps per run; then a
second invocation that keeps the finished run, resumes the unfinished one and survives a
failing one."""

from __future__ import annotations

import fcntl
import json

import pytest

from qarl.cli import main
from qarl.config import load_config
from qarl.paths import qarl_home
from qarl.report import read_metrics
from qarl.report.compare import summarize

ARGS = ["compare", "tiny", "--train.steps=2", "--jobs", "2"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The comparison folder after `qarl compare tiny --arms naive,qarl` (exit status 0), run
    on a $QARL_HOME without warm starts, so the warm start the two arms share is trained by
    compare (its compiled kernels and models are this machine's: a fresh build of the native
    kernels in every child would only add ~30 s)."""
    out = tmp_path_factory.mktemp("runs")
    home = out / "home"
    home.mkdir()
    for kept in ("kernels", "models"):
        (qarl_home() / kept).mkdir(parents=True, exist_ok=True)
        (home / kept).symlink_to(qarl_home() / kept)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QARL_HOME", str(home))
        assert main([*ARGS, "--arms", "naive,qarl", f"--run.output_dir={out}"]) == 0
    return out


def test_the_shared_warm_start_is_trained_once_before_the_runs(compared):
    """Both arms start from one warm start (tiny's follows run.seed; the arms differ only in
    quantization): trained by `qarl sft` into the cache, logged beside the arms, and loaded,
    not trained, by each run."""
    (log,) = (compared / "tiny").glob("warm-start-*.log")
    key = log.stem.removeprefix("warm-start-")
    assert (compared / "home" / "sft" / key / "model.safetensors").exists()
    assert "sft step 30/30" in log.read_text()
    for arm in ("naive", "qarl"):
        assert "sft step" not in (compared / "tiny" / arm / "seed0.log").read_text()


def test_runs_are_train_runs_and_report_is_their_metrics(compared):
    """Each arm/seed is an ordinary, finished run folder with the arm's config; the report's
    table is the one computed from those metrics files, and the plots exist."""
    folder = compared / "tiny"
    runs = {}
    for arm, align in (("naive", "naive"), ("qarl", "kernel")):
        run = folder / arm / "seed0"
        config = load_config(run / "config.toml")
        assert (config.quant.align, config.run.seed, config.train.steps) == (align, 0, 2)
        assert (run / "summary.json").exists() and (folder / arm / "seed0.log").exists()
        rows = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
        # the run's mismatch budget never flags a healthy run's step
        assert [r["contract/over_budget"] for r in rows if r["kind"] == "train"] == [0.0, 0.0]
        runs[arm] = {0: rows}
    report = json.loads((folder / "compare.json").read_text())
    expected = summarize(runs, "fp", "naive")
    assert list(report["arms"]) == ["naive", "qarl"]
    for arm, entry in expected.items():
        for name, stat in entry["figures"].items():
            assert report["arms"][arm]["figures"][name]["values"] == stat.values, name
    text = (folder / "report.md").read_text()
    assert "| `naive` |" in text and "| `qarl` |" in text
    for image in ("accuracy", "mismatch", "errors", "time"):
        assert (folder / f"{image}.png").stat().st_size > 0
    # the aligned learner replays the engine's kernel: no mismatch; the naive one has some
    assert report["arms"]["qarl"]["figures"]["abs_diff_max"]["mean"] == 0.0
    assert report["arms"]["naive"]["figures"]["abs_diff_max"]["mean"] > 0.0


def test_second_compare_keeps_resumes_and_reports_failures(compared, capsys, monkeypatch):
    """Run again: the finished run is not touched (same bytes, same mtimes), the one without
    summary.json completes from its checkpoint, a failing run is reported with its log and
    the others still finish; the exit status is 1."""
    monkeypatch.setenv("QARL_HOME", str(compared / "home"))  # the warm start is cached there
    folder = compared / "tiny"
    kept = {p: (p.read_bytes(), p.stat().st_mtime_ns)
            for p in (folder / "naive" / "seed0").rglob("*") if p.is_file()}
    (folder / "qarl" / "seed0" / "summary.json").unlink()
    locked = folder / "fp" / "seed0"
    locked.mkdir(parents=True)
    with open(locked / ".lock", "w") as lock:  # another process "holds" the fp run
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code = main([*ARGS, "--arms", "naive,qarl,fp", f"--run.output_dir={compared}"])
    err = capsys.readouterr().err
    assert code == 1
    assert "warm start" not in err
    assert "naive/seed0: finished before, not run again" in err
    assert "qarl/seed0: done in" in err
    assert "fp/seed0: FAILED (exit status 2)" in err and "another qarl process" in err
    assert f"log: {folder / 'fp' / 'seed0.log'}" in err
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in kept} == kept
    assert (folder / "qarl" / "seed0" / "summary.json").exists()
    rows = read_metrics(folder / "qarl" / "seed0" / "metrics.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    report = json.loads((folder / "compare.json").read_text())
    assert list(report["arms"]) == ["naive", "qarl"]
