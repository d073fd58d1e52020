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
    from qarl.errors import UserError
    from qarl.native.memory import tune_allocator
    from qarl.train.sft import sft_folder, warm_start

    config = load_config(args.recipe, args.overrides)  # a ConfigError: exit 2
    if config.sft.steps == 0:
        raise UserError(f"recipe {args.recipe!r} has sft.steps = 0: there is no warm start to "
                        "run; set --sft.steps=N")
    tune_allocator()  # as qarl train does
    warm_start(config)
    print(sft_folder(config))
    return 0
