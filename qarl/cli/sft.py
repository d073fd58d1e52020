"""`qarl sft [RECIPE] [--section.key=value ...]`: run (or reuse) a recipe's warm-start SFT and
print the folder of the cached result."""

from __future__ import annotations

import argparse

ACCEPTS_OVERRIDES = True  # --section.key=value, e.g. --sft.steps=300


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default="tiny",
                        help="recipe path or packaged name whose [sft] section to run (default: tiny)")


def run(args: argparse.Namespace) -> int:
    from qarl.config import load_config
    from qarl.native.memory import tune_allocator
    from qarl.train.sft import sft_folder, warm_start

    config = load_config(args.recipe, args.overrides)
    if config.sft.steps == 0:
        print(f"recipe {args.recipe!r} has sft.steps = 0: nothing to do (set --sft.steps=N)")
        return 1
    tune_allocator()  # as qarl train does
    warm_start(config)
    print(sft_folder(config))
    return 0
