"""`qarl export RUN_DIR_OR_CHECKPOINT OUT --format hf|compressed-tensors [--scheme S]`: a
trained policy as a folder that transformers (hf) or vLLM (compressed-tensors) loads; see
qarl/export/README.md for the formats and what is refused."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from qarl.export.run import FORMATS

    parser.add_argument("src", type=Path, help="a run folder (its `latest` checkpoint) or a "
                        "step_NNNNNN checkpoint folder")
    parser.add_argument("out", type=Path, help="the folder to write (new, or empty)")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="hf: full-precision master weights; compressed-tensors: the "
                        "quantized policy in vLLM's layout")
    parser.add_argument("--scheme", default=None,
                        help="compressed-tensors only: quantize with this qarl scheme instead "
                        "of the run's quant.scheme")


def run(args: argparse.Namespace) -> int:
    from qarl.export import export_run

    out = export_run(args.src, args.out, args.format, scheme=args.scheme)  # UserError: exit 2
    print(f"wrote {args.format} folder: {out}")
    return 0
