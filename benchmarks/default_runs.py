"""The README's default-run table, regenerated: `qarl train` on the embedded default recipe
once per seed, one run at a time, then the held-out accuracies before and after, wall time
and peak memory per seed, as one JSON object; `--readme` also writes the table into
README.md between its `default-runs` markers, so a change to sampling or kernels (which moves
where a trajectory ends) regenerates the table instead of leaving it stale.

    .venv/bin/python benchmarks/default_runs.py                 # seeds 0 1 2, ~15 min on 2 cores
    .venv/bin/python benchmarks/default_runs.py --readme        # and rewrite the README table
    .venv/bin/python benchmarks/default_runs.py --seeds 0 --train.steps=2   # a smoke run
    .venv/bin/python benchmarks/default_runs.py --from runs/kept --readme   # table of kept runs

Arguments after the options are `qarl train` overrides (the README's table is the default
recipe's: pass none for it). Each run is a child process (`qarl train`, as a user runs it);
its wall time and peak RSS are the child's own (`os.wait4`). The runs' folders go to a
temporary folder unless `--keep DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- default-runs:begin -->", "<!-- default-runs:end -->"
# (column label, eval metric): the deployed quantized policy, the master weights, truncation
COLUMNS = [("deployed W8A8 policy", "eval/accuracy_quantized"),
           ("full-precision master weights", "eval/accuracy_full_precision"),
           ("truncated responses (W8A8)", "eval/truncated_quantized")]


def read_run(seed: int, out: Path) -> dict:
    """The evals before and after of the finished run `out / seed<seed>`."""
    rows = [json.loads(line) for line in (out / f"seed{seed}" / "metrics.jsonl").open()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    return {"seed": seed, "steps": max(r["step"] for r in rows),
            "before": {key: evals[0].get(key) for _, key in COLUMNS},
            "after": {key: evals[-1].get(key) for _, key in COLUMNS}}


def run_seed(seed: int, out: Path, overrides: list[str]) -> dict:
    """One `qarl train` child: its evals before and after, wall seconds and peak RSS."""
    qarl = Path(sys.executable).with_name("qarl")
    args = [str(qarl), "train", f"--run.seed={seed}", f"--run.output_dir={out}",
            f"--run.name=seed{seed}", "--log.progress=false", *overrides]
    began = time.perf_counter()
    with open(out / f"seed{seed}.log", "w") as log:
        child = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        tail = (out / f"seed{seed}.log").read_text().splitlines()[-15:]
        raise SystemExit(f"seed {seed}: `{' '.join(args)}` failed; the end of its output:\n"
                         + "\n".join(tail))
    return {**read_run(seed, out), "wall_s": round(wall, 1),
            "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2)}


def table(results: list[dict]) -> str:
    """The markdown table: one row per seed and their mean."""
    head = "| seed | " + " | ".join(f"{label}: before -> after" for label, _ in COLUMNS) + " |"
    lines = [head, "|---" * (len(COLUMNS) + 1) + "|"]

    def cells(before: dict, after: dict) -> str:
        out = []
        for i, (_, key) in enumerate(COLUMNS):
            b, a = before[key], after[key]
            if a is None or b is None:
                out.append("-")
                continue
            shown = f"**{a:.2f}**" if i == 0 else f"{a:.2f}"  # the deployed policy's, bold
            out.append(f"{b:.2f} -> {shown}")
        return " | ".join(out)

    for r in results:
        lines.append(f"| {r['seed']} | {cells(r['before'], r['after'])} |")
    def mean(side: str, key: str) -> float | None:
        values = [r[side][key] for r in results]
        return None if None in values else sum(values) / len(values)

    if len(results) > 1:
        means = {side: {key: mean(side, key) for _, key in COLUMNS} for side in ("before", "after")}
        lines.append(f"| mean | {cells(means['before'], means['after'])} |")
    return "\n".join(lines)


def write_readme(text: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace README.md's block between the markers `begin` and `end` with `text`."""
    readme = README.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(readme):
        raise SystemExit(f"README.md has no {begin} ... {end} block to replace")
    README.write_text(pattern.sub(lambda _: f"{begin}\n{text}\n{end}", readme), encoding="utf-8")


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's table")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run folders here")
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="read finished runs (seed<k> folders) from here instead of running")
    args, overrides = parser.parse_known_args()
    if args.readme and overrides:
        raise SystemExit("--readme writes the default recipe's table: drop the overrides "
                         f"{overrides}, or drop --readme")
    from qarl.native import machine

    with tempfile.TemporaryDirectory() as scratch:
        out = args.keep or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        results = [read_run(seed, args.source) if args.source else run_seed(seed, out, overrides)
                   for seed in args.seeds]
    text = table(results)
    if args.readme:
        write_readme(text)
    print(json.dumps({"commit": commit(), "overrides": overrides, "machine": machine(),
                      "runs": results, "table": text}, indent=1))


if __name__ == "__main__":
    main()
