"""Where vLLM's w8a8-int8 logprobs leave qarl's on the same codes, printed as one JSON object.
Needs the vllm environment (`make test-vllm` creates .venv-vllm):

    .venv-vllm/bin/python benchmarks/vllm_int8_gap.py --seeds 0 1 2 3 4 --emulate-seeds 0

`--dtype`: what vLLM computes in (`rollout.vllm_dtype`; auto picks bfloat16 on AMX CPUs, whose
int8 kernel takes only 16-bit activations). `--emulate-amx-dispatch` (an AVX-512 VNNI CPU
without AMX): vLLM's AMX-machine int8 kernel, run with VNNI instructions
(`qarl.rollout.vllm_support.emulate_amx_dispatch`).

- `layers`: one prefill of two chat prompts; per vLLM int8 layer (q/k/v and gate/up fused, o,
  down) its output against the exact products (xq wq) s_x s_w in float64, and against the
  emulation of an int16-saturating GEMM (`saturating_int8_dot`: u = q + 128, adjacent pairs
  clamped to int16), both from vLLM's own activation codes; the worst and median relative
  error over layers, and how many activation codes vLLM's quantizer rounds otherwise than
  qarl's `int8_rows`.
- `seeds`: VLLMEngine.generate (6 chat prompts x 16 tokens, temperature 1) scored by the local
  engine (qarl's exact int8 GEMM) and the `fake` learner: mean / max |Δlogp| per seed; the
  local engine's own batch scored by the fake learner (the floor of this model: per-token int8
  activation quantizers amplify last-bit differences); for `--emulate-seeds`, also a local
  engine whose int8 GEMM is the saturating emulation (slow: every int8 GEMM emulated pair by
  pair in int32 tensors).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import qarl.quant.kernels as kernels
from qarl.model import load_model, load_tokenizer
from qarl.quant import numerics as nm
from qarl.quant import quantize_model
from qarl.rollout import LocalEngine
from qarl.rollout.vllm_engine import VLLMEngine
from qarl.rollout.vllm_weights import fused_codes, int8_layer_io, vllm_int8_codes
from qarl.native import machine
from qarl.rollout.vllm_support import (
    KERNEL_AMX, KERNEL_ONEDNN_SATURATING, KERNEL_ONEDNN_VNNI, emulate_amx_dispatch, int8_cpu_kernel,
    int8_gemm_saturates,
)
from qarl.types import SamplingParams

MODEL = "smollm2-135m"
KERNELS = (KERNEL_AMX, KERNEL_ONEDNN_VNNI, KERNEL_ONEDNN_SATURATING)
SUMS = [(3, 4), (5, 2), (7, 8), (1, 9), (6, 6), (2, 8)]


def saturating_int8_dot(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """sum_k xq[m, k] wq[n, k] with oneDNN's non-VNNI arithmetic: u = xq + 128, each adjacent
    pair u_k w_k + u_k+1 w_k+1 clamped to int16, minus 128 sum_k w_k. [M, K], [N, K] -> [M, N]."""
    u = xq.to(torch.int32) + 128  # [M, K]
    out = []
    for w in wq.to(torch.int32).split(64):  # [n, K] row blocks bound the [M, n, K] product
        p = u[:, None, :] * w[None]
        pairs = (p[..., 0::2] + p[..., 1::2]).clamp(-32768, 32767)  # [M, n, K/2]
        out.append(pairs.sum(-1) - 128 * w.sum(-1)[None])
    return torch.cat(out, -1)


def layer_errors(served: VLLMEngine, qarl_model, prompts: list[list[int]]) -> dict:
    """Per vLLM int8 layer on one prefill of `prompts`: relative error of its output against the
    exact and the saturating products of its own activation codes."""
    exact, saturating, other_codes, codes = [], [], 0, 0
    for name, (x, y) in int8_layer_io(served.llm, prompts).items():
        wq, ws = fused_codes(qarl_model, name)
        xq, xs = vllm_int8_codes(x)
        other_codes += int((xq != nm.int8_rows(x)[0]).sum())
        codes += xq.numel()

        def rel(acc):  # ||y - acc s_x s_w|| / ||acc s_x s_w||
            ref = acc.double() * xs.double() * ws.double()[None]
            return float((y.double() - ref).norm() / ref.norm())

        exact.append(rel(xq.double() @ wq.double().T))
        saturating.append(rel(saturating_int8_dot(xq, wq)))
    return {"int8_layers": len(exact), "exact_rel_min": min(exact), "exact_rel_max": max(exact),
            "exact_rel_median": statistics.median(exact), "saturating_rel_max": max(saturating),
            "activation_codes_rounded_otherwise": other_codes, "activation_codes": codes}


def gap(a, b, mask) -> list[float]:
    d = (a - b).abs()[mask]
    return [round(float(d.mean()), 4), round(float(d.max()), 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3, 4])
    parser.add_argument("--emulate-seeds", type=int, nargs="*", default=[])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--emulate-amx-dispatch", action="store_true")
    args = parser.parse_args()
    if args.emulate_amx_dispatch:
        emulate_amx_dispatch()
    tokenizer = load_tokenizer(MODEL)
    base = load_model(MODEL)
    kernel = quantize_model(copy.deepcopy(base), "w8a8-int8", mode="kernel")
    fake = LocalEngine.from_tokenizer(quantize_model(copy.deepcopy(base), "w8a8-int8", mode="fake"),
                                      tokenizer)
    local = LocalEngine.from_tokenizer(copy.deepcopy(kernel), tokenizer)
    emulated = LocalEngine.from_tokenizer(  # the sgemm method calls kernels.exact_int8_gemm
        quantize_model(copy.deepcopy(base), "w8a8-int8", mode="kernel", gemm="sgemm"), tokenizer)
    served = VLLMEngine.from_tokenizer(copy.deepcopy(kernel), tokenizer, Path(tempfile.mkdtemp()),
                                       max_context=512, dtype=args.dtype)
    chats = [tokenizer.apply_chat(q, tokenize=True) for q in
             ("What is 3 + 4? Explain your reasoning step by step.", "Name three colors.")]
    notes = " ".join(served.describe().values())
    out = {"machine": machine(), "vllm_dtype": served.dtype,
           "int8_kernel": next((k for k in KERNELS if k in notes), None),
           "amx_dispatch_emulated": args.emulate_amx_dispatch,
           "int8_gemm_saturates": int8_gemm_saturates(), "layers": layer_errors(served, kernel, chats)}
    prompts = [tokenizer.apply_chat(f"What is {a} + {b}?", tokenize=True) for a, b in SUMS]
    sampling = SamplingParams(max_new_tokens=16)
    seeds = {}
    for seed in args.seeds:
        batch = served.generate(prompts, sampling, seed=seed)
        m = batch.response_mask
        row = {"vllm_vs_local": gap(batch.rollout_logp, local.score(batch, sampling), m),
               "vllm_vs_fake": gap(batch.rollout_logp, fake.score(batch, sampling), m)}
        own = local.generate(prompts, sampling, seed=seed)
        row["local_vs_fake"] = gap(own.rollout_logp, fake.score(own, sampling), own.response_mask)
        if seed in args.emulate_seeds:
            exact_gemm = kernels.exact_int8_gemm
            kernels.exact_int8_gemm = lambda xq, wq, method, chunks=None: saturating_int8_dot(xq, wq)
            try:
                row["vllm_vs_local_saturating"] = gap(batch.rollout_logp,
                                                      emulated.score(batch, sampling), m)
            finally:
                kernels.exact_int8_gemm = exact_gemm
        seeds[seed] = row
    out.update(model=MODEL, unit="|Δlogp| [mean, max] over response tokens", seeds=seeds,
               loadavg=os.getloadavg())
    print(f"vLLM in {served.dtype}; its int8 layers on {out['int8_kernel']}; "
          f"{int8_cpu_kernel()} is this CPU's own", file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
