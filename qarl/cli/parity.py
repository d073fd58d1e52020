"""`qarl parity [RECIPE] [--section.key=value ...] [flags]`: the learner-vs-sampler logprob
mismatch per scheme and alignment (qarl.cli.parity_matrix). With a recipe (or overrides), its
model and its [quant] include / exclude / options are measured, and its quant.scheme is the
default scheme; the flags below override the recipe. A mixture-of-experts model gets each row
without and with routing replay, with the fraction of tokens routed to other experts."""

from __future__ import annotations

import argparse
import sys

from qarl import jsonio
from qarl.cli.args import device, name_list, nonnegative_int, positive_float, positive_int
from qarl.rollout import ENGINES

ACCEPTS_OVERRIDES = True  # --section.key=value on the recipe, checked by qarl.config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe", nargs="?", default=None,
        help="a recipe file or packaged recipe name whose model and [quant] include / exclude / "
        "options to measure, overridable with --section.key=value as for `qarl train` "
        "(default: none; the flags below alone)",
    )
    parser.add_argument("--model", default=None,
                        help="zoo name or model folder (default: the recipe's model.name, else tiny)")
    parser.add_argument("--schemes", type=name_list, default=None,
                        help="comma-separated schemes (default: the recipe's quant.scheme, else "
                        "all of qarl.quant.SCHEMES)")
    served = "; ".join(f"{name}: {','.join(kind.aligns)}" for name, kind in ENGINES.items())
    parser.add_argument("--aligns", type=name_list, default=None,
                        help=f"comma-separated alignment modes (default: those the engine "
                        f"serves, {served})")
    parser.add_argument("--engine", choices=list(ENGINES), default="local",
                        help="what samples the batch: qarl's local engine or vLLM (needs the "
                        "vllm package; see qarl/rollout/README.md) (default: local)")
    parser.add_argument("--prompts", type=positive_int, default=16, help="number of prompts (default: 16)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=24,
                        help="response length limit (default: 24)")
    parser.add_argument("--temperature", type=positive_float, default=1.0,
                        help="sampling temperature, above 0 (default: 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="prompt and sampling seed")
    parser.add_argument("--no-full-sequence", action="store_true",
                        help="skip the full-sequence (teacher-forced forward) rows")
    parser.add_argument("--lora-rank", type=nonnegative_int, default=None,
                        help="rows with LoRA adapters of this rank on both sides (planted, "
                        "nonzero; default: the recipe's lora.rank, else none)")
    parser.add_argument("--device", type=device, default=None,
                        help="where the sampler and the learners run: 'cpu', 'cuda' or 'cuda:N' "
                        "(default: the recipe's train.device, else cpu)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead")


def run(args: argparse.Namespace) -> int:
    from qarl.cli.parity_matrix import arm_row, check_names, format_table, progress_line, run_arms
    from qarl.config import LoraSection, load_config
    from qarl.model.check import check_model

    quant, model, lora, on = None, args.model or "tiny", None, args.device or "cpu"
    if args.recipe is not None or args.overrides:
        config = load_config(args.recipe, args.overrides)  # a ConfigError: exit 2
        quant, model = config.quant, args.model or config.model.name
        lora = config.lora if config.lora.rank else None
        on = args.device or config.train.device
    if args.lora_rank is not None:
        lora = LoraSection(rank=args.lora_rank) if args.lora_rank else None
    kind = ENGINES[args.engine]
    schemes = args.schemes
    if schemes is None:  # the recipe's scheme, else every scheme the engine serves here
        schemes = [quant.scheme] if quant is not None else list(kind.schemes())
    aligns = args.aligns or list(kind.aligns)
    check_names(schemes, aligns, quant.options if quant is not None else None, args.engine)
    check_model(model)  # a name or folder that cannot load is refused before any model loads
    arms = run_arms(model, schemes, aligns, args.prompts, args.max_new_tokens,
                    args.temperature, args.seed, not args.no_full_sequence, quant, args.engine,
                    lora, on)
    rows = []
    for arm in arms:  # one progress line per arm on stderr
        rows.append(arm_row(arm))
        print(progress_line(arm, rows[-1]), file=sys.stderr)
    print(jsonio.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0
