"""The default recipe's held-out accuracies before and after training, regenerated: `qarl
train` on the embedded default recipe once per seed, one run at a time, then the held-out
accuracies before and after, wall time and peak memory per seed, as one JSON object;
`--results` also writes the table into docs/results.md (section `default-runs`, and the
README's glance row from it), so a change to sampling or kernels (which moves where a
trajectory ends) regenerates the table instead of leaving it stale.

    .venv/bin/python benchmarks/default_runs.py                 # seeds 0 1 2
    .venv/bin/python benchmarks/default_runs.py --results       # and write docs/results.md
    .venv/bin/python benchmarks/default_runs.py --seeds 0 --train.steps=2   # a smoke run
    .venv/bin/python benchmarks/default_runs.py --from runs/kept --results  # table of kept runs
    .venv/bin/python benchmarks/default_runs.py --recipe reasoning_gym --results  # its section

`--recipe` names another packaged recipe (`reasoning_gym`: SmolLM2-135M on reasoning-gym's
chain sums); its table goes to the section `<recipe>-runs`.

Arguments after the options are `qarl train` overrides (the results page's table is the default
recipe's: pass none for it). Each run is a child process (`qarl train`, as a user runs it);
its wall time and peak RSS are the child's own (`os.wait4`). The runs' folders go to a
temporary folder unless `--keep DIR`, which must not hold a run of those seeds already (a
`qarl train` there would resume it, not train it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def run_seed(seed: int, out: Path, overrides: list[str], recipe: str = "default") -> dict:
    """One `qarl train` child: its evals before and after, wall seconds and peak RSS."""
    qarl = Path(sys.executable).with_name("qarl")
    args = [str(qarl), "train", recipe, f"--run.seed={seed}", f"--run.output_dir={out}",
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


def mean_of(results: list[dict], side: str, key: str) -> float | None:
    """The mean over seeds of eval metric `key` at `side` ('before' / 'after'); None if a seed
    lacks it."""
    values = [r[side][key] for r in results]
    return None if None in values else sum(values) / len(values)


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
    if len(results) > 1:
        means = {side: {key: mean_of(results, side, key) for _, key in COLUMNS}
                 for side in ("before", "after")}
        lines.append(f"| mean | {cells(means['before'], means['after'])} |")
    return "\n".join(lines)


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


def notes(results: list[dict], recipe: str = "default") -> str:
    """The results page's words under the table: what the columns are, each run's cost."""
    text = ("Held-out accuracy (and the share of truncated responses) at the first and the last "
            f"evaluation of each `qarl train` run of the {recipe} recipe, `before -> after`; in "
            "bold the deployed W8A8 policy after training.")
    if all("wall_s" in r for r in results):  # runs measured here, not read `--from` a folder
        wall, peak = [r["wall_s"] for r in results], [r["peak_rss_gb"] for r in results]
        text += (f" Each run (one `qarl train` child at a time): {min(wall):.0f}-{max(wall):.0f} s"
                 f" wall, peak RSS {min(peak):.2f}-{max(peak):.2f} GiB.")
    return text


def refuse(message: str) -> None:
    """Bad arguments: the message on stderr, exit status 2, before any run starts."""
    print(f"default_runs.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", default="default",
                        help="a packaged recipe (its quant.scheme should be W8A8 int8, as the "
                        "columns say); its table goes to the section <recipe>-runs")
    parser.add_argument("--results", action="store_true",
                        help="write the table into docs/results.md (section default-runs)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run folders here")
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="read finished runs (seed<k> folders) from here instead of running")
    parser.add_argument("--machine", default=None,
                        help="with --from --results: the machine class the runs ran on "
                        "(default: this machine's, benchmarks/results_page.py machine_class)")
    args, overrides = parser.parse_known_args()
    if args.results and overrides:
        refuse("--results writes the default recipe's table: drop the overrides "
               f"{overrides}, or drop --results")
    from qarl.native import machine

    held = [] if args.keep is None or args.source else [
        f"seed{seed}" for seed in args.seeds if (args.keep / f"seed{seed}").exists()]
    if held:  # `qarl train` would resume those runs (finished: at once), not train them
        refuse(f"--keep {args.keep} already holds {', '.join(held)}: a run there resumes "
               f"instead of training. Give an empty folder, or read the kept runs with "
               f"--from {args.keep}")
    with tempfile.TemporaryDirectory() as scratch:
        out = args.keep or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        results = [read_run(seed, args.source) if args.source
                   else run_seed(seed, out, overrides, args.recipe) for seed in args.seeds]
    text = table(results)
    if args.results:
        from results_page import this_command, write_section

        before, after = (mean_of(results, side, COLUMNS[0][1]) for side in ("before", "after"))
        seeds = " / ".join(str(r["seed"]) for r in results)
        glance = None if None in (before, after) else (
            f"{args.recipe} recipe: deployed W8A8 policy, held-out accuracy",
            f"{before:.2f} -> {after:.2f} (mean of seeds {seeds})")
        title = ("What the default run shows" if args.recipe == "default"
                 else f"What the {args.recipe} recipe's run shows")
        write_section(f"{args.recipe.replace('_', '-')}-runs", title, this_command(), text,
                      notes=notes(results, args.recipe), glance=glance, machine=args.machine)
    print(json.dumps({"commit": commit(), "overrides": overrides, "machine": machine(),
                      "runs": results, "table": text}, indent=1))


if __name__ == "__main__":
    main()
