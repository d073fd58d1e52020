"""`qarl export RUN_DIR_OR_CHECKPOINT OUT --format hf|compressed-tensors|peft [--scheme S]
[--base-only]`: a trained policy as a folder that transformers (hf), vLLM (compressed-tensors)
or peft (a LoRA run's adapters) loads; see qarl/export/README.md for the formats and what is
refused."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from qarl.export.run import FORMATS

    parser.add_argument("src", type=Path, help="a run folder (its `latest` checkpoint) or a "
                        "step_NNNNNN checkpoint folder")
    parser.add_argument("out", type=Path, help="the folder to write (new, or empty)")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="hf: full-precision master weights (a LoRA run's merged); "
                        "compressed-tensors: the quantized policy in vLLM's layout (a LoRA "
                        "run's base); peft: a LoRA run's adapters as a PEFT folder")
    parser.add_argument("--scheme", default=None,
                        help="compressed-tensors only: quantize with this qarl scheme instead "
                        "of the run's quant.scheme")
    parser.add_argument("--base-only", action="store_true",
                        help="hf, a LoRA run: write its base model without the adapters (the "
                        "base a --format peft adapter loads onto)")


def run(args: argparse.Namespace) -> int:
    from qarl.export import export_run

    out = export_run(args.src, args.out, args.format, scheme=args.scheme,
                     merge=not args.base_only, base=_lora_base(args.src))  # UserError: exit 2
    print(f"wrote {args.format} folder: {out}")
    return 0


def _lora_base(src: Path):
    """A LoRA run's base model where its recipe warm-starts (the [sft] cache, trained again
    if it is gone); None otherwise: the recipe's model is the base."""
    from qarl.config import load_config
    from qarl.errors import UserError
    from qarl.export.run import CONFIG_FILE, read_run
    from qarl.train.sft import warm_start

    try:
        policy = read_run(src)
    except UserError:
        return None  # export_run names what is wrong, after its own checks of OUT
    if not policy.lora_rank:
        return None
    return warm_start(load_config(policy.checkpoint / CONFIG_FILE))
