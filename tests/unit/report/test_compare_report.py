"""The comparison report from a fixture of hand-written metrics files: every table number is
the one computed by hand, and only finished runs count."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from qarl.report.compare import curve, gap_closed, relative_speed, stat, summarize
from qarl.errors import UserError
from qarl.report.compare_files import find_runs, write_report

# arm -> seed -> (final deployed accuracy, final master accuracy, seconds per phase per step)
FIXTURE = {
    "ref": {0: (0.75, 0.75, (2.0, 0.0, 0.5, 1.0, 0.5)), 1: (0.75, 0.75, (2.0, 0.0, 0.5, 1.0, 0.5))},
    "base": {0: (0.25, 0.5, (1.0, 0.0, 0.5, 1.0, 0.5)), 1: (0.25, 0.5, (1.0, 0.0, 0.5, 1.0, 0.5))},
    "arm": {0: (0.5, 0.5, (1.0, 0.0, 1.0, 1.5, 0.5)), 1: (0.75, 1.0, (1.0, 0.0, 0.5, 1.0, 0.5))},
}
PHASES = ("generate", "reward", "old_logp", "update", "sync")
CONFIG = """[run]
seed = 0

[compare]
seeds = [0, 1]
reference = "ref"
baseline = "base"

[compare.arms]
ref = {quant = {scheme = "none"}}
base = {quant = {align = "naive"}}
arm = {quant = {align = "kernel"}}
"""


def rows_of(arm: str, seed: int) -> list[dict]:
    """Two training steps and three evaluations; the middle evaluation is not final."""
    deployed, master, phases = FIXTURE[arm][seed]
    times = {f"time/{name}": value for name, value in zip(PHASES, phases)}
    # the reference runs unquantized: its evaluations hold only the full-precision policy
    quantized = {} if arm == "ref" else {"eval/accuracy_quantized": deployed}
    evals = [{"step": step, "kind": "eval", "eval/accuracy_full_precision": acc, **q}
             for step, acc, q in ((0, 0.0, {"eval/accuracy_quantized": 0.0} if quantized else {}),
                                  (1, 0.9, {"eval/accuracy_quantized": 0.9} if quantized else {}),
                                  (2, master, quantized))]
    train = [{"step": step, "kind": "train", "reward/mean": 0.25 * step + seed,
              "mismatch/abs_diff_mean": 0.125 * step, "mismatch/abs_diff_max": step + seed,
              "mismatch/seq_ratio_min": 1.0 - 0.25 * step, "errors/rep_ngram": None,
              "errors/truncated": 0.5 * (step - 1), "sync/changed_code_frac": 0.25 * step,
              **times} for step in (1, 2)]
    return [evals[0], train[0], evals[1], train[1], evals[2]]


def write_fixture(folder: Path) -> None:
    for arm, seeds in FIXTURE.items():
        for seed in seeds:
            run = folder / arm / f"seed{seed}"
            run.mkdir(parents=True)
            (run / "metrics.jsonl").write_text(
                "".join(json.dumps(row) + "\n" for row in rows_of(arm, seed)))
            (run / "config.toml").write_text(CONFIG)
            (run / "summary.json").write_text("{}")
    unfinished = folder / "arm" / "seed2"  # would change every mean of `arm` if it counted
    unfinished.mkdir()
    (unfinished / "metrics.jsonl").write_text(json.dumps(
        {"step": 2, "kind": "eval", "eval/accuracy_quantized": 0.0}) + "\n")


def test_table_numbers_from_fixture(tmp_path):
    """Means, sample stds, gap closed and relative speed are exactly the hand-computed ones."""
    write_fixture(tmp_path)
    write_report(tmp_path)
    report = json.loads((tmp_path / "compare.json").read_text())
    assert (report["reference"], report["baseline"]) == ("ref", "base")
    assert list(report["arms"]) == ["ref", "base", "arm"]  # the recipe's order
    assert report["unfinished"] == ["arm/seed2"]
    arm, ref = report["arms"]["arm"], report["arms"]["ref"]
    assert arm["seeds"] == [0, 1]
    figures = arm["figures"]
    # final evaluation (step 2), not the better middle one; sample std of [0.5, 0.75]
    assert figures["accuracy_deployed"] == {"mean": 0.625, "std": math.sqrt(0.03125),
                                            "values": [0.5, 0.75]}
    assert figures["accuracy_master"]["mean"] == 0.75
    # the first evaluation (step 0), not the middle one; the reference's is full precision's
    assert figures["accuracy_deployed_first"]["values"] == [0.0, 0.0]
    assert figures["accuracy_master_first"]["values"] == [0.0, 0.0]
    assert ref["figures"]["accuracy_deployed_first"]["values"] == [0.0, 0.0]
    assert figures["changed_code_frac"]["values"] == [0.375, 0.375]  # mean of 0.25, 0.5
    # the unquantized reference is deployed at full precision
    assert ref["figures"]["accuracy_deployed"] == {"mean": 0.75, "std": 0.0,
                                                   "values": [0.75, 0.75]}
    # (0.625 - 0.25) / (0.75 - 0.25)
    assert arm["gap_closed_pct"] == 75.0
    assert report["arms"]["base"]["gap_closed_pct"] == 0.0 and ref["gap_closed_pct"] == 100.0
    # per-step means over steps 1, 2, then over seeds
    assert figures["reward"]["values"] == [0.375, 1.375] and figures["reward"]["mean"] == 0.875
    assert figures["abs_diff_mean"]["values"] == [0.1875, 0.1875]
    assert figures["abs_diff_max"]["values"] == [2.0, 3.0]  # max over steps
    assert figures["seq_ratio_min"]["values"] == [0.5, 0.5]  # min over steps
    assert figures["rep_ngram"] == {"mean": None, "std": None, "values": []}  # null skipped
    assert figures["truncated"]["mean"] == 0.25
    assert figures["garbled"]["mean"] is None  # never logged
    # seconds per step: seed 0 sums to 4.0, seed 1 to 3.0; the reference to 4.0
    assert figures["time_step"]["values"] == [4.0, 3.0]
    assert figures["time_old_logp"]["values"] == [1.0, 0.5]
    assert arm["relative_speed"] == 4.0 / 3.5
    assert ref["relative_speed"] == 1.0 and report["arms"]["base"]["relative_speed"] == 4.0 / 3.0


def test_report_markdown_and_plots(tmp_path):
    """report.md holds the table rows with mean ± std and n/a where a number is undefined;
    the four plots are written."""
    write_fixture(tmp_path)
    paths = write_report(tmp_path)
    assert [p.name for p in paths] == ["report.md", "compare.json", "accuracy.png",
                                       "mismatch.png", "errors.png", "time.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    text = (tmp_path / "report.md").read_text()
    assert "| `arm` | 0.625 ± 0.177 | 0.750 ± 0.354 | 75.0 % |" in text
    assert "| `ref` | 0.750 ± 0.000 | 0.750 ± 0.000 | 100.0 % |" in text
    assert "| `arm` | 1.00 ± 0.00 | 0.00 ± 0.00 | 0.75 ± 0.35 | 1.25 ± 0.35 | 0.50 ± 0.00 | " \
           "3.50 ± 0.71 | 1.14x |" in text
    assert "Unfinished runs left out: `arm/seed2`" in text
    assert "garbled" not in text.split("## Error-token")[1].split("##")[0]
    assert "repeated n-grams" not in text  # logged only as null


def test_finished_runs_only(tmp_path):
    """A run counts once its summary.json exists; folders not named seedK are ignored."""
    write_fixture(tmp_path)
    (tmp_path / "arm" / "seed_old").mkdir()
    (tmp_path / "arm" / "seed_old" / "metrics.jsonl").write_text("")
    finished, unfinished = find_runs(tmp_path)
    assert {arm: sorted(seeds) for arm, seeds in finished.items()} == {
        "arm": [0, 1], "base": [0, 1], "ref": [0, 1]}
    assert unfinished == [tmp_path / "arm" / "seed2"]


def test_no_finished_runs_is_a_clear_error(tmp_path):
    """A folder with no finished run, one that does not exist, a `qarl train` run folder: a
    UserError naming the folder and what to give instead, nothing written."""
    with pytest.raises(UserError, match="no finished runs under .*ARM/seedK"):
        write_report(tmp_path)
    with pytest.raises(UserError, match="nowhere does not exist; give the folder `qarl compare`"):
        write_report(tmp_path / "nowhere")
    (tmp_path / "config.toml").write_text("[run]\n")
    with pytest.raises(UserError, match="is the run folder of a `qarl train` run"):
        write_report(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


def test_a_damaged_run_file_is_named(tmp_path):
    """A finished run's metrics.jsonl line that is not a row, or its config.toml that does not
    parse: a UserError naming the file (and line), with where to restore it from; no report
    file written."""
    write_fixture(tmp_path)
    metrics = tmp_path / "base" / "seed1" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "kind": "tr\n')
    with pytest.raises(UserError, match=rf"{metrics} line 6 is not a row of metrics .*step_NNNNNN/metrics.jsonl"):
        write_report(tmp_path)
    metrics.write_text('{"step": 1}\n')
    with pytest.raises(UserError, match="line 1 is not a row of metrics \\(no 'step' and 'kind'\\)"):
        write_report(tmp_path)
    write_fixture(tmp_path / "again")
    config = tmp_path / "again" / "arm" / "seed0" / "config.toml"
    config.write_text("[compare\n")
    with pytest.raises(UserError, match=rf"{config} does not parse .*step_NNNNNN/config.toml"):
        write_report(tmp_path / "again")
    assert not list(tmp_path.glob("**/report.md")) and not list(tmp_path.glob("**/compare.json"))


def test_pure_pieces():
    """Gap closed is n/a without a gap to close; one seed has no std; the curve band is the
    min and max over seeds at each step."""
    assert gap_closed(0.5, 0.4, 0.4) is None and gap_closed(0.5, None, 0.1) is None
    assert gap_closed(0.1, 0.5, 0.3) == pytest.approx(-100.0)
    assert relative_speed(2.0, 1.0) == 0.5 and relative_speed(None, 1.0) is None
    assert stat([0.5, None]).std is None and stat([None]).mean is None
    line = curve({0: rows_of("arm", 0), 1: rows_of("arm", 1)}, "reward/mean")
    assert (line.steps, line.low, line.high, line.mean) == ([1, 2], [0.25, 0.5], [1.25, 1.5],
                                                            [0.75, 1.0])
    table = summarize({"a": {0: rows_of("arm", 0)}})
    assert table["a"]["gap_closed_pct"] is None and table["a"]["relative_speed"] is None


def test_held_out_seeds_are_reported_apart(tmp_path):
    """With compare.held_out_seeds = [1], seed 1's runs count in no figure of the main
    tables (seed 0 alone there) and have their own: compare.json's `held_out`, and report.md's
    held-out table, gap closed from the held-out seed's own reference and baseline. A folder
    with only held-out runs finished is refused, nothing written."""
    write_fixture(tmp_path)
    for config in tmp_path.glob("*/seed*/config.toml"):
        config.write_text(CONFIG.replace("seeds = [0, 1]", "seeds = [0]\nheld_out_seeds = [1]"))
    write_report(tmp_path)
    report = json.loads((tmp_path / "compare.json").read_text())
    main, held_out = report["arms"]["arm"], report["held_out"]["arm"]
    assert main["seeds"] == [0] and held_out["seeds"] == [1]
    assert main["figures"]["accuracy_deployed"]["values"] == [0.5]
    assert held_out["figures"]["accuracy_deployed"]["values"] == [0.75]
    assert main["gap_closed_pct"] == 50.0 and held_out["gap_closed_pct"] == 100.0  # (x-.25)/.5
    assert list(report["held_out"]) == ["ref", "base", "arm"]
    text = (tmp_path / "report.md").read_text()
    main_text, held_out_text = text.split("## Held-out seeds")
    assert "| `arm` | 0.500 | 0.500 | 50.0 % |" in main_text
    assert "Seeds 1 (compare.held_out_seeds)" in held_out_text
    assert "| `arm` | 0.750 | 1.000 | 100.0 % |" in held_out_text
    for summary in tmp_path.glob("*/seed0/summary.json"):
        summary.unlink()
    (tmp_path / "report.md").unlink()
    with pytest.raises(UserError, match=r"held-out seeds \[1\] only; run the development"):
        write_report(tmp_path)
    assert not (tmp_path / "report.md").exists()


def test_without_held_out_seeds_compare_json_says_none(tmp_path):
    """A comparison without held-out seeds keeps every seed in the main tables and writes
    `held_out: null`, and its report has no held-out table."""
    write_fixture(tmp_path)
    write_report(tmp_path)
    assert json.loads((tmp_path / "compare.json").read_text())["held_out"] is None
    assert "## Held-out seeds" not in (tmp_path / "report.md").read_text()
