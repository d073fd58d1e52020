"""The README's TBPO-comparison table ("Where TBPO can act"), written from a finished
`qarl compare tbpo` folder's compare.json: per arm, the deployed policy's held-out accuracy by
seed (mean ± half the range), the master weights' accuracy, and the training means of the
mismatch, clips, band drops, error-token rates and seconds per step, as one JSON object;
`--readme` also writes the table into README.md between its `tbpo-table` markers, so a new
comparison regenerates the table instead of leaving it stale.

    .venv/bin/qarl compare tbpo --jobs 2                        # the runs (README: the budget)
    .venv/bin/python benchmarks/tbpo_table.py runs/tbpo         # the table's figures as JSON
    .venv/bin/python benchmarks/tbpo_table.py runs/tbpo --readme   # and rewrite the README table
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from default_runs import write_readme

BEGIN, END = "<!-- tbpo-table:begin -->", "<!-- tbpo-table:end -->"
NAMES = {"fp-grpo": "full-precision GRPO (reference)", "fake-grpo": "`fake` + GRPO",
         "fake-grpo-tis": "`fake` + GRPO + token TIS", "fake-gspo": "`fake` + GSPO",
         "fake-tbpo": "`fake` + TBPO", "naive-grpo": "`naive` + GRPO",
         "naive-tbpo": "`naive` + TBPO", "kernel-tbpo": "`kernel` + TBPO (exact alignment)"}
# (column, compare.json figures, format of their means over seeds)
COLUMNS = [("master", ("accuracy_master",), "{:.2f}"),
           ("mean \\|Δlogp\\|", ("abs_diff_mean",), "{:.4f}"),
           ("clipped (A < 0)", ("clip_frac", "clip_frac_neg"), "{:.3f} ({:.3f})"),
           ("band drops", ("band_drop",), "{:.3f}"), ("garbled", ("garbled",), "{:.3f}"),
           ("low-prob tokens", ("lowprob_tokens",), "{:.4f}"),
           ("repeated 4-grams", ("rep_ngram",), "{:.3f}"), ("truncated", ("truncated",), "{:.3f}"),
           ("s/step", ("time_step",), "{:.1f}")]


def figures(table: dict) -> dict:
    """{arm: {"seeds", "deployed": [per seed], "mean", "half_range", figure: mean, ...}}."""
    out = {}
    for arm, entry in table["arms"].items():
        figs = entry["figures"]
        deployed = figs["accuracy_deployed"]["values"]
        out[arm] = {"seeds": entry["seeds"], "deployed": deployed,
                    "mean": sum(deployed) / len(deployed),
                    "half_range": (max(deployed) - min(deployed)) / 2,
                    **{key: figs[key]["mean"] for _, keys, _ in COLUMNS for key in keys}}
    return out


def markdown(rows: dict) -> str:
    seeds = " / ".join(map(str, next(iter(rows.values()))["seeds"]))
    head = ["arm", f"deployed (seeds {seeds})", *(label for label, _, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, row in rows.items():
        values = " / ".join(f"{v:g}" for v in row["deployed"])
        cells = [NAMES.get(arm, f"`{arm}`"),
                 f"{row['mean']:.3f} ± {row['half_range']:.3f} ({values})"]
        for _, keys, fmt in COLUMNS:  # '-' where the arm has no such figure (GRPO: no band)
            means = [row[key] for key in keys]
            cells.append("-" if None in means else fmt.format(*means))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a qarl compare tbpo folder (has compare.json)")
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's table")
    args = parser.parse_args()
    source = args.folder / "compare.json"
    if not source.exists():
        raise SystemExit(f"{source} does not exist: run `qarl compare tbpo` (or `qarl report "
                         f"{args.folder}`) first")
    table = json.loads(source.read_text())
    if table.get("unfinished"):
        raise SystemExit(f"{source}: unfinished runs {table['unfinished']}; the same qarl "
                         "compare command resumes them")
    rows = figures(table)
    if args.readme:
        write_readme(markdown(rows), BEGIN, END)
    print(json.dumps({"folder": str(args.folder), "arms": rows}, indent=1))


if __name__ == "__main__":
    main()
