"""benchmarks/compare_table.py: a finished `qarl compare` folder's table from its compare.json,
and its section of the results page."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare_table  # noqa: E402


def _entry(deployed, band_drop, gap_closed):
    means = {key: 0.5 for _, keys, _ in compare_table.COLUMNS for key in keys}
    means.update(band_drop=band_drop, abs_diff_mean=0.00283, time_step=41.25)
    del means["gap_closed_pct"]  # the arm's own entry, not a figure
    figs = {key: {"mean": value, "values": []} for key, value in means.items()}
    figs["accuracy_deployed"] = {"mean": sum(deployed) / len(deployed), "values": deployed}
    return {"seeds": [0, 1, 2], "overrides": {"quant.scheme": "none"}, "figures": figs,
            "gap_closed_pct": gap_closed}


COMPARE = {"reference": "fp-grpo", "baseline": "naive-grpo", "unfinished": [], "arms": {
    "fp-grpo": _entry([0.75, 0.925, 0.8], None, 100.0),
    "fake-tbpo": _entry([0.025, 0.35, 0.35], 0.0, None),
}}


def test_rows_carry_seeds_half_range_and_missing_figures():
    """Each arm's row: the mean deployed accuracy ± half the seeds' range with every seed's
    value, '-' where the arm has no such figure (GRPO has no trust band, a gap needs a
    baseline), the clip fraction with its negative-advantage share in brackets; the reference
    arm is named as such."""
    lines = compare_table.markdown(compare_table.figures(COMPARE), COMPARE).splitlines()
    assert lines[0].startswith("| arm | deployed (seeds 0 / 1 / 2) | master | gap closed | "
                               "mean \\|Δlogp\\| |")

    def cells(line):
        return line.replace("\\|", "").count("|")  # an escaped bar is no column

    assert len(lines) == 4 and all(cells(line) == cells(lines[0]) for line in lines)
    fp, fake = lines[2].split(" | "), lines[3].split(" | ")
    assert fp[0] == "| `fp-grpo` (reference)" and fake[0] == "| `fake-tbpo`"
    assert fp[1] == "0.825 ± 0.088 (0.75 / 0.925 / 0.8)"
    assert fp[3] == "100 %" and fake[3] == "-"
    assert fp[6] == "-" and fake[6] == "0.000"
    assert fake[1] == "0.242 ± 0.162 (0.025 / 0.35 / 0.35)"
    assert fake[4] == "0.0028" and fake[5] == "0.500 (0.500)" and fake[-1] == "41.2 |"


def test_a_column_no_arm_has_is_left_out():
    """Without any arm's band drops (a GRPO-only comparison) the table has no such column."""
    grpo = {**COMPARE, "arms": {"fp-grpo": COMPARE["arms"]["fp-grpo"]}}
    head = compare_table.markdown(compare_table.figures(grpo), grpo).splitlines()[0]
    assert "band drops" not in head and "garbled" in head


def test_the_glance_names_the_reference_and_the_best_other_arm():
    """The glance reads the reference arm's mean deployed accuracy and the best other arm's."""
    what, reading = compare_table.glance(compare_table.figures(COMPARE), COMPARE, "tbpo")
    assert what == "`qarl compare tbpo`: deployed held-out accuracy"
    assert reading == "reference `fp-grpo` 0.825; best other arm `fake-tbpo` 0.242"
    with_baseline = {**COMPARE, "arms": {**COMPARE["arms"],
                                         "naive-grpo": _entry([0.2, 0.3, 0.1], None, 0.0)}}
    _, reading = compare_table.glance(compare_table.figures(with_baseline), with_baseline, "x")
    assert reading == ("reference `fp-grpo` 0.825; baseline `naive-grpo` 0.200; "
                       "best other arm `fake-tbpo` 0.242")  # the fixture has no gap closed
    with_baseline["arms"]["fake-tbpo"] = {**with_baseline["arms"]["fake-tbpo"],
                                          "gap_closed_pct": 6.7}
    _, reading = compare_table.glance(compare_table.figures(with_baseline), with_baseline, "x")
    assert reading.endswith("best other arm `fake-tbpo` 0.242 (7 % of the gap closed)")


def _started(entry, before, master=None, master_before=None):
    figs = {**entry["figures"], "accuracy_deployed_first": {"mean": None, "values": before}}
    if master is not None:
        figs["accuracy_master"] = {"mean": None, "values": master}
        figs["accuracy_master_first"] = {"mean": None, "values": master_before}
    return {**entry, "figures": figs}


def test_the_reading_pairs_seeds_and_measures_the_evaluation_noise():
    """The reading: the widest spread of the reference's and the baseline's starts (same
    weights, one evaluation per seed) is the evaluation's noise; a summary names the arms
    beyond it in every seed (deployed against the baseline, master against its start); each
    arm minus the baseline
    seed by seed, with a sign verdict only when every seed agrees and 'beyond the noise' only
    when each seed's difference exceeds it, and its change from its own start; the master
    weights' change from the start; the trust band's drops and the clips of the arms that
    have a band; the gap between reference and baseline."""
    table = {**COMPARE, "arms": {
        "fp-grpo": _started(_entry([0.75, 0.925, 0.8], None, 100.0), [0.7, 0.9, 0.8]),
        "naive-grpo": _started(_entry([0.25, 0.3, 0.35], None, 0.0), [0.3, 0.35, 0.25],
                               [0.5, 0.25, 0.5], [0.75, 0.75, 0.5]),
        "fake-tbpo": _started(_entry([0.3, 0.35, 0.3], 0.125, None), [0.3, 0.35, 0.25]),
    }}
    lines = compare_table.reading(compare_table.figures(table), table)
    assert lines[0] == ("Evaluation noise: every seed's runs start from the same weights, "
                        "evaluated once per seed before training: `fp-grpo` 0.700 to 0.900; "
                        "`naive-grpo` 0.250 to 0.350 (deployed policy). A difference within "
                        "the widest spread (0.200) is within one evaluation's noise.")
    assert lines[1] == ("Beyond the noise in every seed, against the baseline's deployed "
                        "accuracy: `fp-grpo` (above); in the master weights' change from the "
                        "start: no arm.")
    assert lines[2] == ("`fp-grpo` − `naive-grpo`, seed by seed: +0.500 / +0.625 / +0.450 "
                        "(mean +0.525; above in every seed, each by more than the noise); its "
                        "own change from the start: +0.050 / +0.025 / +0.000.")
    assert lines[3] == ("`fake-tbpo` − `naive-grpo`, seed by seed: +0.050 / +0.050 / -0.050 "
                        "(mean +0.017; no consistent sign); its own change from the start: "
                        "+0.000 / +0.000 / +0.050.")
    assert lines[4] == ("The full-precision master weights' change from the start, seed by "
                        "seed: `naive-grpo` -0.250 / -0.500 / +0.000.")
    assert lines[5] == ("`fake-tbpo`: the trust band dropped 0.125 of the sequences; clipped "
                        "0.500 of the sequences (0.500 of those with A < 0).")
    assert lines[6] == ("The gap to close: `fp-grpo` − `naive-grpo` = +0.525 in mean "
                        "deployed accuracy.")
    assert len(lines) == 7
    # every seed the same sign, but not every one beyond the noise
    table["arms"]["fake-tbpo"] = _started(_entry([0.35, 0.4, 0.6], 0.125, None), [0.3] * 3)
    lines = compare_table.reading(compare_table.figures(table), table)
    assert "(mean +0.150; above in every seed, not every seed beyond the noise)" in lines[3]
    # a master that falls beyond the noise in every seed is named
    table["arms"]["naive-grpo"] = _started(_entry([0.25, 0.3, 0.35], None, 0.0),
                                           [0.3, 0.35, 0.25], [0.5, 0.25, 0.25], [0.75] * 3)
    lines = compare_table.reading(compare_table.figures(table), table)
    assert lines[1].endswith("in the master weights' change from the start: `naive-grpo` "
                             "(fell).")
    # seeds that do not match pair nothing; one seed has no spread and no sign verdict
    table["arms"]["fake-tbpo"] = {**table["arms"]["fake-tbpo"], "seeds": [3]}
    assert not any(line.startswith("`fake-tbpo` −") for line in
                   compare_table.reading(compare_table.figures(table), table))
    one = {**table, "arms": {arm: {**_started(_entry([v], None, None), [0.5]), "seeds": [3]}
                             for arm, v in (("fp-grpo", 0.8), ("naive-grpo", 0.3))}}
    lines = compare_table.reading(compare_table.figures(one), one)
    assert lines == ["`fp-grpo` − `naive-grpo`, seed by seed: +0.500 (mean +0.500; one seed).",
                     "The gap to close: `fp-grpo` − `naive-grpo` = +0.500 in mean deployed "
                     "accuracy."]


def test_refuses_an_unfinished_comparison(tmp_path):
    """A folder whose runs are not all finished names them and how to resume, and writes
    nothing."""
    unfinished = {**COMPARE, "unfinished": ["fake-tbpo/seed2"]}
    (tmp_path / "compare.json").write_text(json.dumps(unfinished))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare_table.py"),
                           str(tmp_path), "--results"], capture_output=True, text=True)
    assert done.returncode != 0
    assert "fake-tbpo/seed2" in done.stderr and "resumes" in done.stderr


def test_held_out_rows_come_from_the_held_out_part_alone():
    """The held-out seeds' rows are read from compare.json's `held_out`, apart from the
    development rows; a comparison without held-out seeds has none."""
    held = {**COMPARE, "held_out": {"fake-tbpo": {**_entry([0.5], 0.0, 10.0), "seeds": [3]}}}
    rows, held_out = compare_table.figures(held), compare_table.figures(held, "held_out")
    assert rows["fake-tbpo"]["deployed"] == [0.025, 0.35, 0.35]
    assert list(held_out) == ["fake-tbpo"]
    assert (held_out["fake-tbpo"]["seeds"], held_out["fake-tbpo"]["deployed"]) == ([3], [0.5])
    assert compare_table.figures(COMPARE, "held_out") == {}
    assert compare_table.figures({**COMPARE, "held_out": None}, "held_out") == {}


def test_the_notes_carry_the_comparisons_wall_time(tmp_path, monkeypatch, capsys):
    """--wall-s puts the whole comparison's wall time and the number of runs into the section's
    notes, saying whether the warm start was in it; without it the notes name no time."""
    import results_page

    folder = tmp_path / "claim"
    folder.mkdir()
    (folder / "compare.json").write_text(json.dumps(COMPARE))
    written = []
    monkeypatch.setattr(results_page, "write_section",
                        lambda key, title, command, body, **kw: written.append((key, kw)))
    for extra in (["--wall-s", "3685", "--warm-start", "cached"], [],
                  ["--wall-s", "3685", "--warm-start", "cached", "--warm-start-s", "1022"]):
        monkeypatch.setattr(sys, "argv", ["compare_table.py", str(folder), "--results", *extra])
        compare_table.main()
    (key, with_wall), (_, without), (_, fresh) = written
    assert key == "compare-claim"
    assert ("The whole `qarl compare claim` command (6 runs) took 61 minutes wall, its warm "
            "start found in the cache (not included).") in with_wall["notes"]
    assert "minutes wall" not in without["notes"] and "qarl sft" not in with_wall["notes"]
    assert ("(not included). `qarl sft claim` from an empty $QARL_HOME (the model's "
            "preparation included) took 17 minutes alone: 78 minutes in all.") in fresh["notes"]
    capsys.readouterr()
