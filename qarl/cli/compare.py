"""`qarl compare [RECIPE] [--seeds 0,1,2] [--arms a,b] [--jobs N] [--section.key=value ...]`:
run the arms of a recipe's [compare] section side by side, then write their report."""

from __future__ import annotations

import argparse
import sys

from qarl.cli.args import int_list, name_list, positive_int

ACCEPTS_OVERRIDES = True  # --section.key=value, applied to every arm after its own overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe", nargs="?", default="compare",
        help="a recipe with a [compare] section, file or packaged name (default: compare; "
        "'tiny' is the quick version). --section.key=value overrides apply to every arm, "
        "after the arm's own overrides (docs/config.md, [compare])",
    )
    parser.add_argument("--seeds", type=int_list, default=None,
                        help="seeds to run, e.g. 0,1,2 (default: compare.seeds of the recipe); "
                        "the recipe's compare.held_out_seeds run too, reported apart")
    parser.add_argument("--arms", type=name_list, default=None,
                        help="arms to run, in this order, e.g. fp-grpo,qarl-tbpo (default: "
                        "every arm not listed in compare.optional)")
    parser.add_argument("--jobs", type=positive_int, default=1,
                        help="runs at once; the CPU cores are split among them (default: 1)")


def run(args: argparse.Namespace) -> int:
    from qarl.cli.compare_runs import WarmStartFailed, plan_runs, run_all
    from qarl.config import ConfigError, load_arms, parse_overrides
    from qarl.report.compare_files import write_report

    try:
        overrides = parse_overrides(args.overrides)
        if args.seeds is not None:
            overrides["compare.seeds"] = args.seeds
        plan = load_arms(args.recipe, overrides, args.arms)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    runs = plan_runs(plan)
    held_out = next(iter(plan.configs.values())).compare.held_out_seeds
    seeds = [seed for seed in plan.seeds if seed not in held_out]
    print(f"{len(runs)} runs ({len(plan.configs)} arms x seeds {seeds}"
          + (f" and held-out {held_out}" if held_out else "") + f") in "
          f"{plan.folder}, {args.jobs} at a time", file=sys.stderr)
    try:
        failed = run_all(plan, runs, args.jobs)
    except KeyboardInterrupt:
        print("interrupted; the same command resumes (finished runs are kept)", file=sys.stderr)
        return 130
    except WarmStartFailed as err:
        print(f"{err}\nno run was started; fix the warm start and run the same command again "
              "(finished runs are kept)", file=sys.stderr)
        return 1
    if len(failed) < len(runs):
        paths = write_report(plan.folder)
        print(paths[0].read_text())
        print("report: " + ", ".join(str(path) for path in paths))
    if failed:
        print(f"{len(failed)} of {len(runs)} runs failed: "
              + ", ".join(f"{run.name} (log: {run.log})" for run in failed), file=sys.stderr)
        return 1
    return 0
