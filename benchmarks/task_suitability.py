"""Which tasks suit which model, before any training: a model's held-out accuracy on each task
in full precision and in each quantization format, with the error-token rates and the mean
response length, as one JSON object; `--results` writes the table into docs/results.md
(section `task-suitability`).

A task to train on with quantized rollouts is one where the model scores above zero (there is
a signal to learn from) and the quantized policy is close to, but measurably below, the full
precision one (there is a gap for alignment to matter). Every cell decodes the same held-out
prompts (the task's eval split, `--problems` of them) with the same sampling and seed; only the
engine's weights differ: each format quantizes the linears inside the decoder blocks as
`quant.scheme` does (the engine's copy of a run), rewards are the tasks' own.

    .venv/bin/python benchmarks/task_suitability.py                           # every default cell
    .venv/bin/python benchmarks/task_suitability.py --problems 48 --results   # the page's table
    .venv/bin/python benchmarks/task_suitability.py --tasks addition chain_sum --formats fp32 int8
    .venv/bin/python benchmarks/task_suitability.py --cells cells.json   # resumable, cell by cell
    .venv/bin/python benchmarks/task_suitability.py --task \
        'sums3=reasoning_gym:{"dataset": "chain_sum", "max_terms": 3}'        # a task of your own

reasoning-gym's tasks need the `qarl[reasoning-gym]` extra; they use its "direct" system prompt
(the answer between <answer> tags, no working), the others the recipe default (none).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from qarl.algo.diagnostics import error_token_metrics
from qarl.config import QuantSection, TaskSection
from qarl.model import load_model, load_tokenizer
from qarl.rollout import LocalEngine
from qarl.tasks import RewardRunner, make_task
from qarl.train.data import PromptEncoder
from qarl.train.evaluate import generate_all
from qarl.train.policy import engine_copy
from qarl.types import SamplingParams

DIRECT = {"system": "direct"}
# (label, task name, options): the built-in tasks, then reasoning-gym generators at sizes a
# small model can start on
TASKS = [
    ("addition", "addition", {"digits": 1}),
    ("column_addition", "column_addition", {"digits": 2}),
    ("chain_sum", "reasoning_gym", {"dataset": "chain_sum", "min_terms": 2, "max_terms": 2,
                                    "max_digits": 1, **DIRECT}),
    ("basic_arithmetic", "reasoning_gym", {"dataset": "basic_arithmetic", "max_terms": 2,
                                           "max_digits": 1, "operators": ["+", "-", "*"],
                                           "allow_parentheses": False,
                                           "allow_negation": False, **DIRECT}),
    ("gcd", "reasoning_gym", {"dataset": "gcd", "max_value": 20, **DIRECT}),
    ("number_sorting", "reasoning_gym", {"dataset": "number_sorting", "min_numbers": 3,
                                         "max_numbers": 3, "max_decimals": 0, **DIRECT}),
    ("spell_backward", "reasoning_gym", {"dataset": "spell_backward", "max_word_len": 5,
                                         **DIRECT}),
    ("letter_counting", "reasoning_gym", {"dataset": "letter_counting", "min_words": 3,
                                          "max_words": 5, **DIRECT}),
]
# (label, quant.scheme, quant.options)
FORMATS = [
    ("fp32", "none", {}),
    ("int8", "w8a8-int8", {}),
    ("fp8", "w8a8-fp8", {}),
    ("int4-g32", "w4a16-int4", {"group_size": 32}),
    ("int4-g64", "w4a16-int4", {"group_size": 64}),  # 128 does not divide SmolLM2's 576
    ("nvfp4", "w4a16-nvfp4", {}),
    ("w4a8", "w4a8-int", {}),
]
FORMAT_NAMES = {"fp32": "full precision", "int8": "W8A8 int8", "fp8": "W8A8 FP8",
                "int4-g32": "W4A16 int4 g32", "int4-g64": "W4A16 int4 g64",
                "nvfp4": "W4A16 NVFP4", "w4a8": "W4A8 int"}


def parse_task(text: str) -> tuple[str, str, dict]:
    """'LABEL=NAME:JSON' -> (label, task name, options)."""
    label, _, rest = text.partition("=")
    name, _, options = rest.partition(":")
    if not label or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: use LABEL=TASK:JSON-OPTIONS")
    return label, name, json.loads(options) if options else {}


def score_cell(engine: LocalEngine, tokenizer, task, encoder: PromptEncoder, examples,
               sampling: SamplingParams, seed: int) -> dict:
    """Accuracy, mean reward, error-token rates and mean length of one engine on one task."""
    began = time.perf_counter()
    batch = generate_all(engine, encoder.encode_prompts(examples), sampling, seed)
    completions = [tokenizer.decode(ids[mask].tolist())
                   for ids, mask in zip(batch.response_ids, batch.response_mask)]
    with RewardRunner(task.reward_spec, num_workers=0) as runner:
        result = runner.score([(ex.prompt, c, ex.reward_kwargs())
                               for ex, c in zip(examples, completions)])
    scored = [r for r in result.rewards if r is not None]
    grammar = getattr(task, "grammar_ok", None)
    errors = error_token_metrics(batch.response_ids, batch.response_mask, batch.finish_reasons,
                                 grammar_ok=[grammar(c) for c in completions] if grammar else None)
    return {"accuracy": sum(r >= 1.0 for r in scored) / len(examples),
            "reward_mean": sum(scored) / len(scored) if scored else None,
            "reward_failed": result.counts["error"] + result.counts["timeout"],
            "length_mean": batch.response_mask.sum(1).float().mean().item(), **errors,
            "seconds": time.perf_counter() - began, "sample": completions[0][:120]}


def measure(args, tasks, formats) -> dict:
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, greedy=args.temperature == 0,
                              temperature=args.temperature or 1.0)
    prepared = []
    for label, name, options in tasks:
        task = make_task(name, **options)
        encoder = PromptEncoder(TaskSection(name=name, options=options,
                                            max_prompt_tokens=1024), tokenizer, task)
        prepared.append((label, task, encoder, task.examples("eval", args.problems, args.seed)))
    settings = {"model": args.model, "problems": args.problems, "seed": args.seed,
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    cells: dict[str, dict[str, dict]] = {label: {} for label, *_ in tasks}
    kept = json.loads(args.cells.read_text()) if args.cells and args.cells.is_file() else None
    if kept is not None and kept["settings"] != settings:
        raise SystemExit(f"{args.cells} holds cells measured with {kept['settings']}, not "
                         f"{settings}; give another --cells file")
    for fmt, scheme, options in formats:
        engine = None
        for label, task, encoder, examples in prepared:
            done = (kept or {}).get("cells", {}).get(label, {}).get(fmt)
            if done is not None:  # measured by an earlier invocation with these settings
                cells[label][fmt] = done
                continue
            engine = engine or LocalEngine.from_tokenizer(engine_copy(model, QuantSection(
                scheme=scheme, options=options)), tokenizer)
            cells[label][fmt] = score_cell(engine, tokenizer, task, encoder, examples, sampling,
                                           args.seed)
            if args.cells:  # after every cell, so an interrupted run resumes where it stopped
                args.cells.parent.mkdir(parents=True, exist_ok=True)
                args.cells.write_text(json.dumps({"settings": settings, "cells": cells}))
            cell = cells[label][fmt]
            print(f"{label:>18} {fmt:>10} accuracy={cell['accuracy']:.3f} "
                  f"length={cell['length_mean']:.1f} ({cell['seconds']:.0f} s)", file=sys.stderr)
        del engine
    return {"model": args.model, "problems": args.problems, "max_new_tokens":
            args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
            "tasks": {label: {"task": name, "options": options} for label, name, options in tasks},
            "formats": {fmt: {"scheme": s, "options": o} for fmt, s, o in formats},
            "cells": cells}


def markdown(out: dict) -> str:
    """One row per (task, format): accuracy and its difference from full precision, mean
    reward, error-token rates, mean length."""
    lines = ["| task | format | accuracy | vs full precision | mean reward | repeated n-grams | "
             "truncated | mean length |", "|---|---|---|---|---|---|---|---|"]
    for label, row in out["cells"].items():
        base = row.get("fp32", {}).get("accuracy")
        for fmt, cell in row.items():
            diff = "" if base is None or fmt == "fp32" else f"{cell['accuracy'] - base:+.3f}"
            reward = "n/a" if cell["reward_mean"] is None else f"{cell['reward_mean']:.3f}"
            lines.append(f"| {label} | {FORMAT_NAMES.get(fmt, fmt)} | {cell['accuracy']:.3f} | "
                         f"{diff} | {reward} | {cell['rep_ngram']:.3f} | "
                         f"{cell['truncated']:.3f} | {cell['length_mean']:.1f} |")
    return "\n".join(lines)


def notes(out: dict) -> str:
    sampling = ("greedy decoding" if out["temperature"] == 0
                else f"sampled at temperature {out['temperature']}")
    tasks = "; ".join(f"{label}: {spec['task']} {json.dumps(spec['options'])}"
                      for label, spec in out["tasks"].items())
    return (f"{out['model']} before any training, {out['problems']} held-out problems per cell "
            f"(the task's eval split, the same prompts in every format), {sampling}, at most "
            f"{out['max_new_tokens']} new tokens; each format quantizes the linears inside the "
            "decoder blocks, as the engine's copy of a run does. accuracy: reward >= 1; "
            "vs full precision: the difference from the full-precision row of the task "
            f"(one problem is {1 / out['problems']:.3f}); repeated n-grams and truncated: "
            "qarl's error-token metrics (method.md section 5). Tasks: " + tasks + ".")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", nargs="+", choices=[label for label, *_ in TASKS],
                        help="default: all")
    parser.add_argument("--task", action="append", type=parse_task, default=[],
                        help="LABEL=TASK:JSON-OPTIONS, a task of your own (repeatable)")
    parser.add_argument("--formats", nargs="+", choices=[label for label, *_ in FORMATS],
                        help="default: all")
    parser.add_argument("--problems", type=int, default=32, help="held-out prompts per cell")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cells", type=Path, default=None,
                        help="keep each measured cell in this JSON file and skip the cells it "
                        "already holds (same model, problems, tokens, temperature and seed)")
    parser.add_argument("--results", action="store_true",
                        help="write the table into docs/results.md (section task-suitability)")
    args = parser.parse_args()
    tasks = [t for t in TASKS if args.tasks is None or t[0] in args.tasks] + args.task
    formats = [f for f in FORMATS if args.formats is None or f[0] in args.formats]
    out = measure(args, tasks, formats)
    print(json.dumps(out, indent=1))
    if args.results:
        from results_page import this_command, write_section

        write_section("task-suitability", "Which tasks suit SmolLM2-135M, by format",
                      this_command(), markdown(out), notes=notes(out))


if __name__ == "__main__":
    main()
