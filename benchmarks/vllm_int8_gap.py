"""Where vLLM's w8a8-int8 logprobs leave qarl's on the same codes, printed as one JSON object.
Needs the vllm environment (`make test-vllm` creates .venv-vllm):

    .venv-vllm/bin/python benchmarks/vllm_int8_gap.py --seeds 0 1 2 3 4 --emulate-seeds 0

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
  engine whose int8 GEMM is the saturating emulation (slow: minutes per seed on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

import qarl.quant.kernels as kernels
from qarl.model import load_model, load_tokenizer
from qarl.quant import numerics as nm
from qarl.quant import quantize_model
from qarl.rollout import LocalEngine
from qarl.rollout.vllm_engine import VLLMEngine, int8_gemm_saturates
from qarl.types import SamplingParams

MODEL = "smollm2-135m"
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
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
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    seen, hooks = {}, []
    for name, module in served._vllm_model().named_modules():
        if hasattr(module, "scheme"):
            hooks.append(module.register_forward_hook(  # vLLM's linears return (out, bias)
                lambda m, a, o, name=name: seen.__setitem__(name, (a[0].clone(), o[0].clone()))))
    served.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        VllmParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    for h in hooks:
        h.remove()
    exact, saturating, other_codes, codes = [], [], 0, 0
    for name, (x, y) in seen.items():
        parent, _, leaf = name.rpartition(".")
        qws = [qarl_model.get_submodule(f"{parent}.{p}").qweight() for p in FUSED.get(leaf, [leaf])]
        wq, ws = torch.cat([w.codes for w in qws]), torch.cat([w.scales for w in qws])
        x = x.float().contiguous()
        xq = torch.empty_like(x, dtype=torch.int8)  # vLLM's own dynamic per-token quantizer
        xs = torch.empty(x.shape[0], 1)
        torch.ops._C.dynamic_scaled_int8_quant(xq, x, xs, None)
        other_codes += int((xq != nm.int8_rows(x)[0]).sum())
        codes += xq.numel()

        def rel(acc):  # ||y - acc s_x s_w|| / ||acc s_x s_w||
            ref = acc.double() * xs.double() * ws.double()[None]
            return float((y.double() - ref).norm() / ref.norm())

        exact.append(rel(xq.double() @ wq.double().T))
        saturating.append(rel(saturating_int8_dot(xq, wq)))
    return {"int8_layers": len(seen), "exact_rel_min": min(exact), "exact_rel_max": max(exact),
            "exact_rel_median": statistics.median(exact), "saturating_rel_max": max(saturating),
            "activation_codes_rounded_otherwise": other_codes, "activation_codes": codes}


def gap(a, b, mask) -> list[float]:
    d = (a - b).abs()[mask]
    return [round(float(d.mean()), 4), round(float(d.max()), 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3, 4])
    parser.add_argument("--emulate-seeds", type=int, nargs="*", default=[])
    args = parser.parse_args()
    tokenizer = load_tokenizer(MODEL)
    base = load_model(MODEL)
    kernel = quantize_model(copy.deepcopy(base), "w8a8-int8", mode="kernel")
    fake = LocalEngine.from_tokenizer(quantize_model(copy.deepcopy(base), "w8a8-int8", mode="fake"),
                                      tokenizer)
    local = LocalEngine.from_tokenizer(copy.deepcopy(kernel), tokenizer)
    emulated = LocalEngine.from_tokenizer(  # the sgemm method calls kernels.exact_int8_gemm
        quantize_model(copy.deepcopy(base), "w8a8-int8", mode="kernel", gemm="sgemm"), tokenizer)
    served = VLLMEngine.from_tokenizer(copy.deepcopy(kernel), tokenizer, Path(tempfile.mkdtemp()),
                                       max_context=512)
    chats = [tokenizer.apply_chat(q, tokenize=True) for q in
             ("What is 3 + 4? Explain your reasoning step by step.", "Name three colors.")]
    out = {"int8_gemm_saturates": int8_gemm_saturates(), "layers": layer_errors(served, kernel, chats)}
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
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
