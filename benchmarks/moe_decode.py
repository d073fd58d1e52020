"""Decode time per step of `LocalEngine` on a MoE model vs its dense twin, printed as JSON.

`tiny-moe` (8 experts of width 192, top-2, in each of 4 layers) against `tiny` (one MLP of
width 768), same attention, same tokenizer, both from the zoo; each in full precision and
with the rollout format(s) given. Decode time per step is
(time(generate N tokens) - time(generate 1 token)) / (N - 1), greedy, EOS ignored, best of
`--repeats` interleaved runs after a warm-up; process CPU time per step is reported too (the
figure least disturbed by other jobs with --threads 1). The load average before and after is
recorded: absolute times on a loaded machine mean little.

    .venv/bin/python benchmarks/moe_decode.py --batches 1 16 --schemes none w8a8-int8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from qarl.model import load_model
from qarl.quant import SCHEMES, quantize_model
from qarl.rollout import LocalEngine
from qarl.types import SamplingParams


def timed_generate(engine: LocalEngine, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(wall s, process CPU s) of one greedy generation of `tokens` tokens per row."""
    sampling = SamplingParams(max_new_tokens=tokens, greedy=True)
    wall, cpu = time.perf_counter(), time.process_time()
    engine.generate(prompts, sampling, seed=0)
    return time.perf_counter() - wall, time.process_time() - cpu


def per_step(engine: LocalEngine, batch: int, tokens: int, repeats: int) -> dict[str, float]:
    prompts = [[5 + (i % 7), 9, 11, 13] for i in range(batch)]
    timed_generate(engine, prompts, tokens)  # warm-up: packs, kernels
    best = {"long": (float("inf"),) * 2, "short": (float("inf"),) * 2}
    for _ in range(repeats):
        best["long"] = min(best["long"], timed_generate(engine, prompts, tokens))
        best["short"] = min(best["short"], timed_generate(engine, prompts, 1))
    wall = (best["long"][0] - best["short"][0]) / (tokens - 1)
    cpu = (best["long"][1] - best["short"][1]) / (tokens - 1)
    return {"ms_per_step": round(1e3 * wall, 3), "cpu_ms_per_step": round(1e3 * cpu, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--schemes", nargs="+", default=["none", "w8a8-int8"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    for scheme in args.schemes:
        for name in ("tiny", "tiny-moe"):
            model = load_model(name)
            if not SCHEMES[scheme].is_identity:
                quantize_model(model, scheme, mode="kernel")
            engine = LocalEngine(model, eos_token_ids=())
            for batch in args.batches:
                rows.append({"model": name, "scheme": scheme, "batch": batch,
                             **per_step(engine, batch, args.tokens, args.repeats)})
    print(json.dumps({
        "machine": platform.processor() or platform.machine(), "threads": args.threads,
        "torch": torch.__version__, "tokens": args.tokens, "repeats": args.repeats,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()], "rows": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
