"""`qarl train [RECIPE] [--section.key=value ...]`: RL training from a TOML recipe."""

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


def run(args: argparse.Namespace) -> int:
    from qarl.config import ConfigError
    from qarl.train.trainer import train

    try:
        summary = train(args.recipe, args.overrides)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    print(summary["table"])
    print(f"run folder: {summary['run_dir']}")
    return 0
