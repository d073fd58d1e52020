"""`qarl train [RECIPE] [--section.key=value ...]` or `qarl train --resume RUN_DIR`: RL training.

Exit codes: 0 done; 2 a recipe problem (nothing ran); 1 the run was aborted (bad steps in a
row, out of memory: the message says what to change); 128 + signal number (143 for SIGTERM,
130 for SIGINT) when a signal stopped it after saving a checkpoint.
"""

from __future__ import annotations

import argparse
import sys

ACCEPTS_OVERRIDES = True  # --section.key=value, checked by qarl.config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe", nargs="?", default=None,
        help="a recipe file or packaged recipe name (default: default.toml); any key can be "
        "overridden with --section.key=value, e.g. --train.steps=5 (docs/config.md)",
    )
    parser.add_argument(
        "--resume", metavar="RUN_DIR", default=None,
        help="continue the run in RUN_DIR from its latest checkpoint, with the recipe it was "
        "started with; only train.steps, train.micro_batch_size, checkpoint and log settings "
        "may be overridden",
    )


def run(args: argparse.Namespace) -> int:
    from qarl.config import ConfigError
    from qarl.train.guards import RunStopped, TrainingAborted
    from qarl.train.resume import resume_config
    from qarl.train.trainer import train

    if args.resume is not None and args.recipe is not None:
        print(f"give a recipe ({args.recipe}) or --resume {args.resume}, not both: a resumed "
              "run uses the recipe saved in its folder", file=sys.stderr)
        return 2
    try:
        if args.resume is not None:
            summary = train(resume_config(args.resume, args.overrides))
        else:
            summary = train(args.recipe, args.overrides)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    except TrainingAborted as err:
        print(f"training aborted: {err}", file=sys.stderr)
        return 1
    except RunStopped as stop:
        print(stop, file=sys.stderr)
        return stop.exit_code
    print(summary["table"])
    print(f"run folder: {summary['run_dir']}")
    return 0
