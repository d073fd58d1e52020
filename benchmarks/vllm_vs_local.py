"""Decode ms/step of `LocalEngine` vs `VLLMEngine` (vLLM's CPU build here) on the same model,
weights and prompts, printed as one JSON object. Needs the vllm environment (`make test-vllm`
creates .venv-vllm):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/vllm_vs_local.py

Formats: fp32 (both), bf16 (both; vLLM's bf16 kernels), int8 = w8a8-int8 with the same codes
(qarl's int8 GEMM vs vLLM's int8 kernel, vLLM in the dtype `rollout.vllm_dtype = "auto"` picks
here: float32, or bfloat16 on AMX CPUs), int8-bf16 = the same with vLLM in bfloat16. Each
format's entry names vLLM's dtype and the kernel of its int8 layers. Greedy, no stop ids: every row decodes exactly
`--new-tokens` tokens. ms/step = (t(N) - t(1)) / (N - 1), best of `--repeats`, engines
interleaved (benchmarks/engine_throughput.py). vLLM runs eager (no compilation) and sets its
own thread count (it binds OpenMP threads to cores); the load average is recorded since other
jobs on a shared machine move these figures.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import tempfile
from pathlib import Path

import torch

from engine_throughput import decode_ms_per_step  # benchmarks/ is sys.path[0] when run
from qarl.model import load_model
from qarl.native import machine
from qarl.quant import quantize_model
from qarl.rollout import LocalEngine
from qarl.rollout.vllm_engine import VLLMEngine
from qarl.types import SamplingParams

FORMATS = {"fp32": (torch.float32, "none", "auto"), "bf16": (torch.bfloat16, "none", "auto"),
           "int8": (torch.float32, "w8a8-int8", "auto"),
           "int8-bf16": (torch.float32, "w8a8-int8", "bfloat16")}


def engines(model_name: str, fmt: str, folder: Path) -> dict:
    dtype, scheme, vllm_dtype = FORMATS[fmt]
    model = load_model(model_name, dtype=dtype).eval()
    if scheme != "none":
        quantize_model(model, scheme, mode="kernel")
    local = LocalEngine(copy.deepcopy(model), eos_token_ids=())
    served = VLLMEngine(model, folder, eos_token_ids=(), max_context=512, dtype=vllm_dtype)
    return {"local": local, "vllm": served}


def run(model_name: str, fmt: str, batches: list[int], new_tokens: int, repeats: int) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        pair = engines(model_name, fmt, Path(tmp))
        notes = pair["vllm"].describe()
        out["vllm_dtype"] = pair["vllm"].dtype
        out["vllm_int8_kernel"] = next((v.split(" (", 1)[1][:-1] for k, v in notes.items()
                                        if "W8A8" in v), None)
        for batch in batches:
            prompts = [[1, 504, 3458, 314, 216 + i % 8] for i in range(batch)]

            def timed(engine):
                return lambda n: engine.generate(prompts, SamplingParams(max_new_tokens=n,
                                                                         greedy=True), seed=0)

            times = decode_ms_per_step({name: timed(e) for name, e in pair.items()},
                                       new_tokens, repeats)
            out[f"batch{batch}"] = {name: round(wall, 2) for name, (wall, _) in times.items()}
        del pair
        gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--formats", default="fp32,bf16,int8,int8-bf16")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    results = {fmt: run(args.model, fmt, [int(b) for b in args.batches.split(",")],
                        args.new_tokens, args.repeats) for fmt in args.formats.split(",")}
    print(json.dumps({
        "model": args.model, "unit": "decode ms/step (wall)", "new_tokens": args.new_tokens,
        "results": results, "machine": machine(),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
    }, indent=1))


if __name__ == "__main__":
    main()
