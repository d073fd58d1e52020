"""Truncated sampling: the learner/sampler ratio with and without the truncation correction,
and what recording the sampler's kept sets costs. Prints one JSON object; `--results` also
writes the table into docs/results.md (section `truncation`).

    .venv/bin/python benchmarks/truncation.py                      # SmolLM2-135M, top_p 0.8
    .venv/bin/python benchmarks/truncation.py --results
    .venv/bin/python benchmarks/truncation.py --model tiny --prompts 8 --max-new-tokens 8

One batch is sampled by a `kernel`-mode engine of the scheme at top_p (and top_k / min_p if
given). Then for each alignment a learner is built as the trainer builds it and replays the
batch (the decode path old_logp takes) two ways: under the sampler's kept sets
(`rollout.truncation_correction = true`) and over the whole vocabulary (`false`, the batch's
kept sets dropped). Per way: the token ratio exp(old_logp - rollout_logp) (mean, std, min,
max over response tokens) and the sequence ratio exp(sum_t d_t) (mean). The kept mass at each
token is the sampler's own whole-vocabulary probability over its truncated one,
exp(logp_full - logp_kept), which is the biased ratio exactly where the learner's logits equal
the sampler's. Recording: `generate` timed with and without the kept-set recorder (the same
tokens either way, the two alternated, best of `--repeats`), and the bytes the sets take in the batch.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _ratio_stats(d: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """d = old_logp - rollout_logp [N, L]; token and sequence ratios over real tokens."""
    r = torch.exp(d[mask].double())
    seq = torch.exp((d.double() * mask).sum(1))
    return {"token_ratio_mean": r.mean().item(), "token_ratio_std": r.std().item(),
            "token_ratio_min": r.min().item(), "token_ratio_max": r.max().item(),
            "seq_ratio_mean": seq.mean().item()}


class _NoRecord:
    """Stands in for the engine's KeptSets: records nothing (the cost baseline)."""

    def __init__(self, rows, budget):
        self.rows, self.budget = rows, budget

    def add(self, rows, t, kept):
        pass

    def compact(self, length):
        return None, None


def measure(model: str, scheme: str, aligns: list[str], prompts: int, max_new_tokens: int,
            top_p: float, top_k: int, min_p: float, seed: int, repeats: int) -> dict:
    from qarl.cli.parity_matrix import encode_prompts
    from qarl.config import QuantSection
    from qarl.model import load_model, load_tokenizer
    from qarl.quant import export_state
    from qarl.rollout import LocalEngine
    from qarl.rollout import engine as engine_module
    from qarl.train.policy import engine_copy, quantize_learner
    from qarl.types import SamplingParams

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model)
    pristine = load_model(model)
    ids = encode_prompts(tokenizer, prompts, seed)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, top_p=top_p, top_k=top_k,
                              min_p=min_p)
    quant = QuantSection(scheme=scheme, align="kernel")
    sampler = LocalEngine.from_tokenizer(engine_copy(pristine, quant), tokenizer)
    batch = sampler.generate(ids, sampling, seed=seed)  # warm: packs built

    def timed(record: bool) -> tuple[float, object]:
        recorder = engine_module.KeptSets if record else _NoRecord
        with mock.patch.object(engine_module, "KeptSets", recorder):
            start = time.perf_counter()
            out = sampler.generate(ids, sampling, seed=seed)
            return time.perf_counter() - start, out

    # alternated, so a machine whose speed drifts moves both alike; best of the repeats
    with_s = without_s = math.inf
    for _ in range(repeats):
        seconds, batch = timed(True)
        with_s = min(with_s, seconds)
        seconds, plain = timed(False)
        without_s = min(without_s, seconds)
    assert torch.equal(plain.response_ids, batch.response_ids)
    mask = batch.response_mask
    tokens = int(mask.sum())
    kept = batch.kept_counts[mask].double()
    full = sampling.untruncated()
    # the sampler's own whole-vocabulary logprob over its truncated one: the kept mass
    mass = torch.exp(sampler.score(batch.without_kept(), full) - batch.rollout_logp)[mask].double()
    result = {
        "model": model, "scheme": scheme, "prompts": prompts, "max_new_tokens": max_new_tokens,
        "top_p": top_p, "top_k": top_k, "min_p": min_p, "tokens": tokens,
        "kept_mass_mean": mass.mean().item(), "kept_tokens_mean": kept.mean().item(),
        "kept_tokens_max": int(kept.max()),
        "kept_bytes": 4 * (batch.kept_ids.numel() + batch.kept_counts.numel()),
        "kept_bytes_per_token": 4 * (batch.kept_ids.numel() + batch.kept_counts.numel()) / tokens,
        "generate_s_recording": with_s, "generate_s_not_recording": without_s,
        "recording_overhead": with_s / without_s - 1.0, "aligns": {},
    }
    for align in aligns:
        learner = quantize_learner(copy.deepcopy(pristine),
                                   quant.model_copy(update={"align": align}))
        sampler.load_weights(export_state(learner))
        scorer = LocalEngine.from_tokenizer(learner, tokenizer)  # the learner's replay
        corrected = scorer.score(batch, sampling) - batch.rollout_logp
        biased = scorer.score(batch.without_kept(), full) - batch.rollout_logp
        result["aligns"][align] = {
            "corrected": {**_ratio_stats(corrected, mask),
                          "exact": bool(torch.equal(corrected[mask], torch.zeros(tokens)))},
            "uncorrected": _ratio_stats(biased, mask)}
    return result


def markdown(r: dict) -> str:
    lines = ["| alignment | correction | token ratio mean | std | min | max | sequence ratio mean |",
             "|---|---|---|---|---|---|---|"]
    for align, ways in r["aligns"].items():
        for way, label in (("uncorrected", "off (whole vocabulary)"),
                           ("corrected", "on (sampler's kept sets)")):
            s = ways[way]
            exact = " (bit for bit)" if s.get("exact") else ""
            lines.append(f"| `{align}` | {label} | {s['token_ratio_mean']:.4f}{exact} | "
                         f"{s['token_ratio_std']:.2g} | {s['token_ratio_min']:.4f} | "
                         f"{s['token_ratio_max']:.4f} | {s['seq_ratio_mean']:.4f} |")
    return "\n".join(lines)


def notes(r: dict) -> str:
    cut = ", ".join(f"{k} {r[k]}" for k in ("top_p", "top_k", "min_p")
                    if r[k] != {"top_p": 1.0, "top_k": 0, "min_p": 0.0}[k])
    return (f"{r['model']}, `{r['scheme']}` rollouts by qarl's engine, {cut}, one batch of "
            f"{r['prompts']} prompts x {r['max_new_tokens']} tokens ({r['tokens']} response "
            f"tokens). Ratio = exp(old_logp - rollout_logp), the learner's replay against the "
            f"sampler. Mean kept mass {r['kept_mass_mean']:.4f}: the biased ratio's expected "
            f"value. Kept sets: {r['kept_tokens_mean']:.1f} tokens per position on average "
            f"(max {r['kept_tokens_max']}), {r['kept_bytes_per_token']:.0f} bytes per response "
            f"token ({r['kept_bytes'] / 1024:.0f} KiB for the batch); generate "
            f"{r['generate_s_recording']:.2f} s recording them vs "
            f"{r['generate_s_not_recording']:.2f} s not ({100 * r['recording_overhead']:+.1f}%, "
            "best of the repeats, same tokens).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--scheme", default="w8a8-int8")
    parser.add_argument("--aligns", default="kernel,fake")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", action="store_true",
                        help="write the table into docs/results.md (section truncation)")
    args = parser.parse_args()
    result = measure(args.model, args.scheme, args.aligns.split(","), args.prompts,
                     args.max_new_tokens, args.top_p, args.top_k, args.min_p, args.seed,
                     args.repeats)
    if args.results:
        from results_page import this_command, write_section

        kernel = result["aligns"].get("kernel") or next(iter(result["aligns"].values()))
        write_section("truncation", "Truncated sampling: the learner's ratio", this_command(),
                      markdown(result), notes=notes(result),
                      glance=(f"truncated sampling, top_p {args.top_p} ({args.model})",
                              f"ratio {kernel['uncorrected']['token_ratio_mean']:.3f} without "
                              f"the correction, {kernel['corrected']['token_ratio_mean']:.3f} "
                              "with"))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
