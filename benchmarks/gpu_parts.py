"""The Python parts of benchmarks/gpu_check.sh, one part per call. Each writes its figures as
one JSON object to `--json`, rewritten after every unit of work (a scheme, an arm), so a part
stopped at its time limit still leaves what it measured.

    python benchmarks/gpu_parts.py models --out DIR [--quick]
    python benchmarks/gpu_parts.py parity --device cuda [--quick]
    python benchmarks/gpu_parts.py train --model DIR --align kernel --device cuda --steps 3
    python benchmarks/gpu_parts.py step-time --model DIR --device cuda --steps 3 [--arms a,b]

No part downloads anything. The models are built in code: the zoo's `tiny` and random-init
models of real shapes (SHAPES) whose embeddings have their real vocabulary size (the lm_head
is most of a 135M model's work) and whose tokenizer is tiny's, trained in code: ids past its
vocabulary decode to nothing, and random weights write no end token, so every response runs
to rollout.max_new_tokens. Their logprob mismatch and step times are those of the shape. A
model that solves nothing gets no update (every advantage 0), so the `train` and `step-time`
parts score with benchmarks/coin_reward.py: rewards that differ within a group, an update on
every step, as in a learning run.

What each part measures:
- `parity`: `qarl parity`'s matrix (qarl.cli.parity_matrix) on `device`, scheme by scheme;
- `train`: `qarl train` (the default recipe, `--model`) with `train.device`, each step's
  mismatch and seconds per phase from its metrics.jsonl;
- `step-time`: benchmarks/step_time.py's `measure`, one arm at a time (an arm's memory is
  freed before the next), the arms' seconds per step against `bf16` (full-precision rollouts
  and learner in bfloat16: scheme `none`, bf16 masters, lr 0: the baseline a GPU user knows).
Every part adds its peak GPU memory (allocated and reserved, GiB) on CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import resource
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from qarl.model.config import ModelConfig
from qarl.quant import SCHEMES

# Random-init stand-ins of real models: the published configs' shapes (vocabulary included).
SHAPES = {
    "smollm2-135m-shape": ModelConfig(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b-shape": ModelConfig(
        family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        attention_bias=True,
    ),
}
BF16 = {"quant.scheme": "none", "model.master_dtype": "bfloat16", "train.lr": 0.0}
COIN = {"task.reward": "coin_reward:coin"}  # benchmarks/coin_reward.py, beside this script
QUANTIZED = [name for name, scheme in SCHEMES.items() if not scheme.is_identity]


def arm_overrides(name: str) -> dict:
    """An arm of `step-time`: `bf16` (see the module docstring), else a scheme name."""
    return dict(BF16) if name == "bf16" else {"quant.scheme": name}


def memory(device: str) -> dict:
    """Peak memory so far: the GPU's (allocated / reserved by torch) on CUDA, the process's RSS."""
    figures = {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    if device.startswith("cuda"):
        figures["peak_gpu_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        figures["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
    return figures


def release(device: str) -> None:
    """Free what the last unit left (its policy, its engine) before the next is built."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def progress(what: str, began: float) -> None:
    print(f"{what} ({time.perf_counter() - began:.1f} s)", file=sys.stderr, flush=True)


def error_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))[-2000:]


class Figures(dict):
    """The part's JSON object, written to `path` on every `save`."""

    def __init__(self, path: Path, **fields):
        super().__init__(fields)
        self.path = path

    def save(self) -> None:
        self.path.write_text(json.dumps(self, indent=1, default=str) + "\n")


# ---- models --------------------------------------------------------------------------------


def build_shape(name: str, folder: Path, tiny: Path) -> dict:
    """A random-init model of SHAPES[name] in `folder`, with the tiny model's tokenizer."""
    from qarl.model.loading import WEIGHTS_FILE, save_model
    from qarl.model.zoo import MARKER, init_tiny

    eos = json.loads((tiny / "config.json").read_text())["eos_token_id"]
    config = dataclasses.replace(SHAPES[name], eos_token_id=eos)
    model = init_tiny(config)  # tiny's rule: norms 1, every other weight N(0, 0.02^2), seeded
    params = sum(p.numel() for p in model.parameters())
    save_model(model, folder)
    for file in tiny.iterdir():  # the tokenizer files
        if file.name not in ("config.json", WEIGHTS_FILE, MARKER):
            shutil.copyfile(file, folder / file.name)
    return {"path": str(folder), "family": config.family, "params": params,
            "vocab_size": config.vocab_size, "layers": config.num_layers}


def models(args: argparse.Namespace, out: Figures) -> None:
    from qarl.model.zoo import prepare

    began = time.perf_counter()
    tiny = prepare("tiny")
    out["models"] = {"tiny": {"path": str(tiny), "seconds": round(time.perf_counter() - began, 1)}}
    out.save()
    for name in [] if args.quick else SHAPES:
        began = time.perf_counter()
        out["models"][name] = build_shape(name, Path(args.out) / name, tiny)
        out["models"][name]["seconds"] = round(time.perf_counter() - began, 1)
        out.save()
        progress(f"model {name}: {out['models'][name]['params'] / 1e6:.0f}M parameters", began)


# ---- parity --------------------------------------------------------------------------------


def parity(args: argparse.Namespace, out: Figures) -> None:
    """The matrix scheme by scheme: a scheme that fails is an error row, not a lost matrix."""
    from qarl.cli.parity_matrix import parity_matrix
    from qarl.quant import SCHEMES

    prompts, tokens = (4, 8) if args.quick else (16, 24)  # 16 x 24: qarl parity's defaults
    out.update(model=args.model, prompts=prompts, max_new_tokens=tokens, rows=[], errors={})
    for scheme in SCHEMES:
        began = time.perf_counter()
        try:
            out["rows"] += parity_matrix(args.model, [scheme], num_prompts=prompts,
                                         max_new_tokens=tokens, device=args.device)
        except Exception as exc:  # noqa: BLE001 - recorded, and the next scheme runs
            out["errors"][scheme] = error_text(exc)
        progress(f"parity {scheme}: {'error' if scheme in out['errors'] else 'done'}", began)
        out["cells"] = [{k: r[k] for k in ("scheme", "align", "path", "bit_exact",
                                           "mean_abs_dlogp", "max_abs_dlogp")}
                        for r in out["rows"]]
        out.update(memory(args.device))
        out.save()


# ---- train ---------------------------------------------------------------------------------

STEP_KEYS = ("step", "response/length_mean", "policy/grad_norm", "reward/mean")


def train(args: argparse.Namespace, out: Figures) -> None:
    """`qarl train` on the default recipe, in this process (for its peak memory)."""
    import qarl

    with tempfile.TemporaryDirectory(prefix="qarl-gpu-train-") as folder:
        overrides = {"model.name": args.model, "train.device": args.device,
                     "quant.align": args.align, "train.steps": args.steps, "eval.size": 8,
                     "run.output_dir": folder, "run.name": args.align, "log.progress": False,
                     **COIN}
        out.update(overrides={k: v for k, v in overrides.items() if k != "run.output_dir"})
        began = time.perf_counter()
        try:
            qarl.train("default", overrides)
        finally:
            out["seconds"] = round(time.perf_counter() - began, 1)
            metrics = Path(folder) / args.align / "metrics.jsonl"
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            rows = [json.loads(line) for line in lines if line.strip()]
            out["steps"] = [{k: v for k, v in row.items()
                             if k in STEP_KEYS or k.startswith(("mismatch/", "time/"))}
                            for row in rows if "time/update" in row]
            out.update(memory(args.device))
            out.save()


# ---- step time -----------------------------------------------------------------------------


def step_times(args: argparse.Namespace, out: Figures) -> None:
    """benchmarks/step_time.py's `measure`, one arm at a time, each arm's peak memory its own."""
    from step_time import measure

    out.update(model=args.model, steps=args.steps, arms={}, errors={})
    for name in args.arms:
        overrides = {"model.name": args.model, "train.device": args.device, **COIN,
                     **arm_overrides(name)}
        release(args.device)
        began = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(prefix="qarl-gpu-step-") as folder:
                result = measure("default", [(name, overrides)], args.steps, None, folder)
            figures = {k: v for k, v in result["arms"][name].items() if k != "ratio"}
            out["arms"][name] = {**figures, "int8_gemm": result["int8_gemm"], **memory(args.device)}
        except Exception as exc:  # noqa: BLE001 - recorded, and the next arm runs
            out["errors"][name] = error_text(exc)
        progress(f"step time {name}: {'error' if name in out['errors'] else 'done'}", began)
        base = out["arms"].get("bf16", {}).get("step")
        for figures in out["arms"].values():  # > 1: the arm's step is faster than bf16's
            figures["speed_vs_bf16"] = round(base / figures["step"], 3) if base else None
        for key in ("peak_rss_gib", "peak_gpu_allocated_gib", "peak_gpu_reserved_gib"):
            peaks = [figures[key] for figures in out["arms"].values() if key in figures]
            if peaks:  # the part's peak: its largest arm's
                out[key] = max(peaks)
        out.save()


PARTS = {"models": models, "parity": parity, "train": train, "step-time": step_times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("--json", required=True, help="where the part's figures go")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="the CPU dry run's sizes")
    parser.add_argument("--out", default=".", help="models: the folder for the shaped models")
    parser.add_argument("--model", default="tiny", help="a zoo name or a model folder")
    parser.add_argument("--align", default="kernel")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--arms", default=",".join(["bf16", *QUANTIZED]),
                        help="step-time: comma-separated arms, bf16 or scheme names (default: "
                        "bf16 and every quantized scheme)")
    args = parser.parse_args()
    args.arms = [a for a in args.arms.split(",") if a]
    out = Figures(Path(args.json), part=args.part, device=args.device,
                  torch=torch.__version__, qarl=sys.modules["qarl"].__file__)
    out.save()
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(args.device)
    PARTS[args.part](args, out)


if __name__ == "__main__":
    main()
