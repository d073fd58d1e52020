"""benchmarks/tbpo_table.py: the README's TBPO-comparison table from a compare.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tbpo_table  # noqa: E402


def _figures(deployed, band_drop):
    means = {key: 0.5 for _, keys, _ in tbpo_table.COLUMNS for key in keys}
    means.update(band_drop=band_drop, abs_diff_mean=0.00283, time_step=41.25)
    figs = {key: {"mean": value, "values": []} for key, value in means.items()}
    figs["accuracy_deployed"] = {"mean": sum(deployed) / len(deployed), "values": deployed}
    return figs


COMPARE = {"unfinished": [], "arms": {
    "fp-grpo": {"seeds": [0, 1, 2], "figures": _figures([0.75, 0.925, 0.8], None)},
    "fake-tbpo": {"seeds": [0, 1, 2], "figures": _figures([0.025, 0.35, 0.35], 0.0)},
}}


def test_rows_carry_seeds_half_range_and_missing_figures():
    """Each arm's row: the mean deployed accuracy ± half the seeds' range with every seed's
    value, '-' where the arm has no such figure (GRPO has no trust band), the clip fraction
    with its negative-advantage share in brackets."""
    lines = tbpo_table.markdown(tbpo_table.figures(COMPARE)).splitlines()
    assert lines[0].startswith("| arm | deployed (seeds 0 / 1 / 2) | master | mean \\|Δlogp\\| |")
    def cells(line):
        return line.replace("\\|", "").count("|")  # an escaped bar is no column

    assert len(lines) == 4 and all(cells(line) == cells(lines[0]) for line in lines)
    fp, fake = lines[2].split(" | "), lines[3].split(" | ")
    assert fp[0] == "| full-precision GRPO (reference)"
    assert fp[1] == "0.825 ± 0.088 (0.75 / 0.925 / 0.8)"
    assert fp[5] == "-" and fake[5] == "0.000"
    assert fake[1] == "0.242 ± 0.162 (0.025 / 0.35 / 0.35)"
    assert fake[3] == "0.0028" and fake[4] == "0.500 (0.500)" and fake[-1] == "41.2 |"


def test_refuses_an_unfinished_comparison(tmp_path):
    """A folder whose runs are not all finished names them and how to resume, and writes
    nothing."""
    (tmp_path / "compare.json").write_text(json.dumps({**COMPARE, "unfinished": ["fake-tbpo/seed2"]}))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tbpo_table.py"),
                           str(tmp_path), "--readme"], capture_output=True, text=True)
    assert done.returncode != 0
    assert "fake-tbpo/seed2" in done.stderr and "resumes" in done.stderr


def test_the_readme_holds_the_table_block():
    """README.md has the block `--readme` rewrites, with the table's header in it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split(tbpo_table.BEGIN, 1)[1].split(tbpo_table.END, 1)[0]
    assert block.strip().startswith("| arm | deployed (seeds 0 / 1 / 2) |")
