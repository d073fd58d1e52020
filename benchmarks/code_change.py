"""Does the deployed policy move? Per quantization format and learning rate, a short RL run
under `kernel` alignment: the fraction of codes each step changes, by kind of layer, how much
of the master weights' movement the deployed weights follow, and the held-out accuracy of the
deployed (quantized) policy next to its master weights' (the same weights in full precision).
Prints one JSON object; `--results` also writes the tables into docs/results.md (section
`code-change`).

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/code_change.py --results
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/code_change.py --quick    # a smoke run
    .venv/bin/python benchmarks/code_change.py --formats int4-g64 --lrs 1e-5 --steps 8
    .venv/bin/python benchmarks/code_change.py --from out.json --results  # the page from a run

Every cell (format x learning rate) is a run of `--recipe` (default: the comparison's,
SmolLM2-135M on one-digit addition with 16-token answers and GRPO) with the format's
`quant.scheme` and options, `quant.align = "kernel"` and its `train.lr`; the cells of one
format start from the same weights and share their step-0 evaluation (`eval.cache_dir`).
Before the first step the engine gets a push of the starting weights, so step 1's changes
are counted too. Per step:
- codes changed: `sync/changed_code_frac` and its breakdown by kind of layer
  (`qarl.train.sync.layer_kind`), between consecutive pushes; packed 4-bit codes per byte
  (a byte holds two codes). Only the linears inside the decoder blocks are quantized (the
  recipes' `quant.include`): embeddings and the head stay full precision.
- followed: <W_hat_t - W_hat_0, W_t - W_0> / ||W_t - W_0||^2 over the quantized layers,
  W the master weights and W_hat the deployed (dequantized) ones: the share of the master's
  movement since step 0 that the deployed weights made along it. 1: they follow it (round to
  nearest moves a code with a probability proportional to how far its master moved, so on
  average they do); 0: they are frozen. noise: ||(W_hat_t - W_hat_0) - (W_t - W_0)|| /
  ||W_t - W_0||, how far the deployed movement strays from the master's, relative to it.
Held-out accuracy of both policies before the first step and after the last (`evaluate`:
the engine, and a full-precision engine over the master weights).

Why these sizes (the whole default run within about 30 minutes on 2 cores at one thread,
the other core left to other work; the JSON holds each cell's seconds): the update is a
step's largest phase, and FP8 and NVFP4 run exact emulations, slower than int8 and int4, so
15 cells leave about 5 steps each. Rollout batches of 16 (4 prompts x 4 responses) instead
of the recipe's 32 halve the update and keep 4 groups per step, so few steps go without
signal. Adam's first step moves nearly every weight by lr and later ones by at most about
lr, so 5 steps at 1e-4 move the weights further than the default recipe's 16 at 2e-5, which
train its deployed policy most of the way (docs/results.md): the learning rates 1e-6, 1e-5
(the recipes') and 1e-4 span weights that barely move in 5 steps to weights that move far.
48 held-out prompts sampled at temperature 1 with one seed for both policies. int4 at group
128 is not among the defaults: SmolLM2's hidden size 576 is not a multiple of 128
(`--formats int4-g128` on a model whose is); groups 32 and 64 are.
`--quick`: the `tiny` recipe, two formats, two steps, for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# the cores this process may run on, read before torch loads: at one thread its OpenMP
# runtime pins the process to one core, and the page names the machine, not the pinning
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from qarl.config import load_config  # noqa: E402
from qarl.quant import quant_layers  # noqa: E402
from qarl.train.evaluate import evaluate  # noqa: E402
from qarl.train.folder import open_run  # noqa: E402
from qarl.train.sft import warm_start  # noqa: E402
from qarl.train.trainer import rl_step  # noqa: E402
from results_page import cores, machine_class, this_command, write_section  # noqa: E402

# (label, quant.scheme, quant.options)
FORMATS = [
    ("int8", "w8a8-int8", {}),
    ("fp8", "w8a8-fp8", {}),
    ("int4-g64", "w4a16-int4", {"group_size": 64}),
    ("int4-g32", "w4a16-int4", {"group_size": 32}),
    ("nvfp4", "w4a16-nvfp4", {}),
    ("int4-g128", "w4a16-int4", {"group_size": 128}),  # not a default: see the docstring
]
DEFAULT_FORMATS = ["int8", "fp8", "int4-g64", "int4-g32", "nvfp4"]
FORMAT_NAMES = {"int8": "W8A8 int8", "fp8": "W8A8 FP8", "int4-g64": "W4A16 int4 g64",
                "int4-g32": "W4A16 int4 g32", "int4-g128": "W4A16 int4 g128",
                "nvfp4": "W4A16 NVFP4"}
KINDS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIZES = {  # (recipe, steps, rollout batch, group size, eval prompts, learning rates, formats)
    "full": ("compare", 5, 16, 4, 48, [1e-6, 1e-5, 1e-4], DEFAULT_FORMATS),
    "quick": ("tiny", 2, 32, 4, 16, [3e-4], ["int8", "int4-g32"]),
}


# ---- the deployed weights against the master's ---------------------------------------------


def snapshot(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per quantized layer: (master weight, deployed weight dequantized), fp32 copies."""
    return {name: (layer.weight.detach().float().clone(),
                   layer.scheme.dequantize(layer.qweight()).float())
            for name, layer in quant_layers(model).items()}


def following(start: dict, now: dict) -> dict[str, float]:
    """followed and noise of the module docstring, from two `snapshot`s of one model:
    <dW_hat, dW> / ||dW||^2 and ||dW_hat - dW|| / ||dW||, summed over the layers."""
    inner = master_sq = stray_sq = 0.0
    for name, (w0, q0) in start.items():
        w, q = now[name]
        moved, deployed = w - w0, q - q0  # [N, K] each
        inner += float((moved.double() * deployed.double()).sum())
        master_sq += float(moved.double().square().sum())
        stray_sq += float((deployed - moved).double().square().sum())
    if master_sq == 0:
        return {"followed": None, "noise": None}
    return {"followed": inner / master_sq, "noise": (stray_sq / master_sq) ** 0.5}


# ---- one cell ------------------------------------------------------------------------------


def measure_cell(recipe: str, fmt: str, lr: float, sizes: dict, out: str) -> dict:
    """One run: `steps` RL steps of `recipe` in the format `fmt` at learning rate `lr`."""
    _, scheme, options = next(f for f in FORMATS if f[0] == fmt)
    config = load_config(recipe, {
        "run.output_dir": out, "run.name": f"{fmt}-lr{lr:g}", "quant.scheme": scheme,
        "quant.options": options, "quant.align": "kernel", "train.lr": lr,
        "train.steps": sizes["steps"], "rollout.batch_size": sizes["batch"],
        "rollout.group_size": sizes["group"], "task.eval_size": sizes["eval"],
        "eval.cache_dir": str(Path(out) / "eval-cache"), "log.progress": False})
    began = time.perf_counter()
    with open_run(config, learner=warm_start(config)) as (_, policy, data):
        model = policy.learner.model
        policy.sync.push()  # the starting weights: step 1's push is then compared with them
        before = evaluate(policy, data, config)
        start, steps = snapshot(model), []
        for step in range(sizes["steps"]):
            m = rl_step(policy, data, config, step)
            kinds = {k.rpartition("/")[2]: v for k, v in m.items()
                     if k.startswith("sync/changed_code_frac/")}
            steps.append({"codes": m.get("sync/changed_code_frac"), "kinds": kinds,
                          "scale_drift": m.get("sync/scale_rel_drift"),
                          "reward": m.get("reward/accuracy"),
                          "no_signal": m.get("guard/no_signal", 0.0),
                          **following(start, snapshot(model))})
            print(f"{fmt:>9} lr {lr:g} step {step + 1}: codes {steps[-1]['codes']:.5f} "
                  f"followed {steps[-1]['followed']}", file=sys.stderr)
        after = evaluate(policy, data, config)
    accuracy = {side: {policy_: e.get(f"eval/accuracy_{key}") for policy_, key in
                       (("deployed", "quantized"), ("master", "full_precision"))}
                for side, e in (("before", before), ("after", after))}
    return {"format": fmt, "scheme": scheme, "options": options, "lr": lr, "steps": steps,
            "accuracy": accuracy, "seconds": time.perf_counter() - began}


# ---- summary and the page ------------------------------------------------------------------


def mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(cell: dict) -> dict:
    """Means over a cell's steps (codes per step, by kind) and its end state."""
    steps = cell["steps"]
    return {"codes_per_step": mean([s["codes"] for s in steps]),
            "kinds_per_step": {k: mean([s["kinds"].get(k) for s in steps])
                               for k in dict.fromkeys(k for s in steps for k in s["kinds"])},
            "followed": steps[-1]["followed"], "noise": steps[-1]["noise"],
            "no_signal_steps": int(sum(s["no_signal"] for s in steps))}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.3f}%"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(cells: list[dict]) -> str:
    """One row per cell: codes changed per step (all, by kind), followed and noise at the end,
    held-out accuracy of the deployed policy and of the master weights, before -> after."""
    kinds = [k for k in KINDS if any(k in c["summary"]["kinds_per_step"] for c in cells)]
    kinds += sorted({k for c in cells for k in c["summary"]["kinds_per_step"]} - set(kinds))
    lines = ["| format | lr | codes changed / step | " + " | ".join(kinds) + " | followed | noise"
             " | deployed: before -> after | master: before -> after |",
             "|" + "---|" * (len(kinds) + 7)]
    for c in cells:
        s, a = c["summary"], c["accuracy"]
        lines.append(
            f"| {FORMAT_NAMES.get(c['format'], c['format'])} | {c['lr']:g} | "
            f"{_pct(s['codes_per_step'])} | "
            + " | ".join(_pct(s["kinds_per_step"].get(k)) for k in kinds)
            + f" | {_num(s['followed'])} | {_num(s['noise'], 1)} | "
            f"{_num(a['before']['deployed'])} -> **{_num(a['after']['deployed'])}** | "
            f"{_num(a['before']['master'])} -> {_num(a['after']['master'])} |")
    return "\n".join(lines)


def notes(out: dict) -> str:
    return (f"Recipe `{out['recipe']}` under `kernel` alignment, one run per format and "
            f"learning rate: {out['steps']} RL steps of {out['batch']} responses ("
            f"{out['batch'] // out['group']} prompts x {out['group']}), seed {out['seed']}. "
            "codes changed / step: the mean over the steps of the fraction of codes that differ "
            "from the previous push (`sync/changed_code_frac`), overall and by kind of layer "
            "(packed 4-bit codes per byte, two codes each); only the linears inside the decoder "
            "blocks are quantized, embeddings and head stay full precision. followed: after the "
            "last step, <W_hat - W_hat_0, W - W_0> / ||W - W_0||^2 over the quantized layers (W "
            "master, W_hat deployed): the share of the master's movement the deployed weights "
            "made along it (1: they follow it on average; 0: frozen). noise: ||(W_hat - W_hat_0)"
            " - (W - W_0)|| / ||W - W_0||. Accuracy: held-out, "
            f"{out['eval']} prompts sampled at temperature 1 with one seed (one prompt is "
            f"{1 / out['eval']:.3f}), before the first step and after the last; in bold the "
            "deployed (quantized) policy; master: the same weights in full precision. The "
            f"whole run: {out['wall_s'] / 60:.0f} minutes at {out['threads']} thread(s); the "
            "script's docstring says why these sizes.")


def glance(out: dict, lr: float = 1e-5) -> tuple[str, str] | None:
    """The page's glance row: codes changed per step and `followed` over the formats at the
    recipes' learning rate; None when no cell ran at it."""
    at = [c["summary"] for c in out["cells"] if c["lr"] == lr]
    if not at:
        return None
    codes = [s["codes_per_step"] for s in at]
    followed = [s["followed"] for s in at if s["followed"] is not None]
    return (f"deployed codes changed per step at lr {lr:g}, {len(at)} formats "
            f"(`kernel`, recipe `{out['recipe']}`)",
            f"{100 * min(codes):.3f}-{100 * max(codes):.3f}% per step; followed "
            f"{min(followed):.2f}-{max(followed):.2f} of the master's movement")


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    recipe, steps, batch, group, eval_size, lrs, formats = SIZES["quick" if args.quick else "full"]
    sizes = {"steps": args.steps or steps, "batch": batch, "group": group, "eval": eval_size}
    recipe = args.recipe or recipe
    began, cells = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as out:
        for fmt in args.formats or formats:
            for lr in args.lrs or lrs:
                cell = measure_cell(recipe, fmt, lr, sizes, out)
                cell["summary"] = summarize(cell)
                cells.append(cell)
    machine = machine_class().replace(f"; {cores()} cores;", f"; {CORES} cores;")
    return {"recipe": recipe, **sizes, "seed": load_config(recipe).run.seed,
            "threads": torch.get_num_threads(), "wall_s": time.perf_counter() - began,
            "command": this_command(), "machine": machine, "cells": cells}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the tiny recipe, two formats, two steps: a smoke run")
    parser.add_argument("--recipe", help="default: compare (quick: tiny)")
    parser.add_argument("--formats", nargs="+", choices=[f[0] for f in FORMATS])
    parser.add_argument("--lrs", nargs="+", type=float)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--from", dest="source", type=Path,
                        help="a JSON this script printed: its table instead of a new run (the "
                        "page names the command and machine that measured it)")
    parser.add_argument("--results", action="store_true",
                        help="write the table into docs/results.md (section code-change)")
    args = parser.parse_args()
    result = json.loads(args.source.read_text()) if args.source else measure(args)
    if args.results:
        write_section("code-change", "Does the deployed policy move? Codes changed per step",
                      result["command"], markdown(result["cells"]), notes=notes(result),
                      glance=glance(result), machine=result["machine"])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
