"""`qarl eval [RECIPE] [--checkpoint DIR] [--section.key=value ...]`: held-out evaluation.

Evaluates the recipe's model (or a checkpoint's master weights; a LoRA checkpoint's adapters
on the recipe's base, with the recipe's [lora]) on the task's eval split with
the quantized engine (the deployed policy) and, unless eval.full_precision is false, with the
full-precision master weights. Prints a table, or JSON with --json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ACCEPTS_OVERRIDES = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default=None, help="recipe file or packaged name")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a checkpoint folder (runs/NAME/step_000020) whose weights to evaluate")
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON")


def run(args: argparse.Namespace) -> int:
    import torch

    from qarl import jsonio
    from qarl.config import load_config
    from qarl.model import DTYPES
    from qarl.train.evaluate import evaluate
    from qarl.train.folder import open_run
    from qarl.train.sft import warm_start

    config = load_config(args.recipe, args.overrides)  # a ConfigError: exit 2
    # Its own run folder: never overwrite (or wait on the lock of) the training run's.
    config = config.model_copy(update={"run": config.run.model_copy(
        update={"name": f"{config.run.name}-eval"})})
    from qarl.model import load_model
    from qarl.train.checkpoint import load_weights

    if args.checkpoint is not None:
        check_checkpoint(args.checkpoint, config)  # before any model loads or trains
    adapters = args.checkpoint is not None and config.lora.rank > 0  # on the recipe's base
    if args.checkpoint is not None and not adapters:
        learner = load_model(config.model.name, dtype=DTYPES[config.model.master_dtype])
        load_weights(args.checkpoint, learner)
    else:
        learner = warm_start(config)
    with open_run(config, learner=learner) as (_, policy, data), torch.no_grad():
        if adapters:  # a LoRA checkpoint holds the adapters: into the learner, then the engine
            load_weights(args.checkpoint, policy.learner.model)
            policy.sync.push()
        metrics = evaluate(policy, data, config)
    if args.json:
        print(jsonio.dumps(metrics, indent=1))
    else:
        for key, value in sorted(metrics.items()):
            print(f"{key:45s} {value:.4f}")
    return 0


def check_checkpoint(folder: Path, config) -> None:
    """Raise UserError unless `folder` is a checkpoint whose weights fit the recipe's model (its
    LoRA adapters where the recipe has [lora]), read from the weights file's header against the
    model's structure on the meta device: no weights loaded, no warm start run."""
    from qarl.errors import UserError
    from qarl.lora.recipe import attach_adapters
    from qarl.model import load_skeleton
    from qarl.lora.fit import weights_problem
    from qarl.train.checkpoint import POINTER

    where = "pass a step_NNNNNN folder of a run (e.g. runs/NAME/step_000020)"
    if not folder.exists():
        raise UserError(f"--checkpoint {folder} does not exist; {where}")
    if not folder.is_dir():
        raise UserError(f"--checkpoint {folder} is a file, not a checkpoint folder; {where}")
    if not (folder / "model.safetensors").is_file():
        named = (folder / POINTER).read_text().strip() if (folder / POINTER).is_file() else ""
        raise UserError(f"no model.safetensors in {folder}: " + (
            f"it is a run folder; pass its checkpoint, --checkpoint {folder / named}" if named
            else where))
    skeleton = load_skeleton(config.model.name)
    if config.lora.rank:
        attach_adapters(skeleton, config.lora, init="zeros")
    why = weights_problem(folder, skeleton)
    if why is not None:
        raise UserError(f"{why}; evaluate it with the recipe it was trained with: qarl eval "
                        f"{folder / 'config.toml'} --checkpoint {folder}")
