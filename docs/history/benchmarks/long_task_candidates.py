"""Candidate tasks for long rollouts: what a quantized sampler writes on each, before training.

For TBPO to have something to act on, responses must be long enough to go wrong: this
measures, per candidate (task, options, response budget, optional SFT warm start) and per
rollout format, what the untrained policy's quantized sampler produces on held-out prompts
at the training temperature, as one JSON object (and a markdown table with --table):

- reward and accuracy (room to improve), mean response length, truncated responses;
- error tokens (method.md section 5): repeated 4-grams, repeat runs, garbled lines (tasks with
  a grammar), low-probability tokens (full-precision learner probability < 1e-3);
- the mismatch the learner would see: mean |old_logp - rollout_logp| per token for a naive
  (full-precision) learner and a `fake` (float-emulated quantizer) learner, overall and in the
  last quarter of the response budget (where error tokens accumulate).

    .venv/bin/python benchmarks/long_task_candidates.py               # every candidate, ~15 min
    .venv/bin/python benchmarks/long_task_candidates.py --only column3 --formats w4a16-int4

The full-precision row of a candidate is its engine in `none` (the mismatch columns then
measure the decode path against itself: 0). Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile

import torch

CANDIDATES = {
    # one-digit sums answered freely: SmolLM2 explains at length when the budget allows
    "addition1-64": {"task.name": "addition", "task.options": {"digits": 1},
                     "rollout.max_new_tokens": 64},
    # three-digit sums, free form
    "addition3-64": {"task.name": "addition", "task.options": {"digits": 3},
                     "rollout.max_new_tokens": 64},
    # column addition without a warm start: the format is in the prompt only
    "column3": {"task.name": "column_addition", "task.options": {"digits": 3},
                "rollout.max_new_tokens": 96},
    # column addition after a short SFT on gold column lines (the format learned, the carries not)
    "column3-sft": {"task.name": "column_addition", "task.options": {"digits": 3},
                    "rollout.max_new_tokens": 96, "sft.steps": 20, "sft.lr": 2e-5,
                    "sft.batch_size": 16},
    # longer SFT: the format and some of the sums
    "column3-sft60": {"task.name": "column_addition", "task.options": {"digits": 3},
                      "rollout.max_new_tokens": 96, "sft.steps": 60, "sft.lr": 5e-5,
                      "sft.batch_size": 16},
    # four digits (five lines, ~70 tokens) after the longer SFT
    "column4-sft60": {"task.name": "column_addition", "task.options": {"digits": 4},
                      "rollout.max_new_tokens": 112, "sft.steps": 60, "sft.lr": 5e-5,
                      "sft.batch_size": 16},
}
FORMATS = ("none", "w8a8-int8", "w4a16-int4")


def measure(name: str, overrides: dict, scheme: str, prompts: int, samples: int,
            out: str) -> dict:
    from qarl.algo.diagnostics import error_token_metrics, lowprob_tokens, mismatch_metrics
    from qarl.config import load_config
    from qarl.rollout import LocalEngine
    from qarl.train.phases import reward_metrics, reward_responses
    from qarl.train.setup import open_run, quantize_learner, sampling_params
    from qarl.train.sft import warm_start

    config = load_config("default", {
        "run.output_dir": out, "run.name": f"{name}-{scheme}", "run.resume": False,
        "log.progress": False, "quant.scheme": scheme, "quant.align": "naive",
        "eval.size": prompts, **overrides})
    warm = warm_start(config, log=lambda *_: None)
    with open_run(config, learner=copy.deepcopy(warm) if warm is not None else None) as (
            _, policy, data):
        examples = data.eval_examples[:prompts]
        prompt_ids = [p for p in data.prompts.encode_prompts(examples) for _ in range(samples)]
        sampling = sampling_params(config.rollout)
        batch = policy.engine.generate(prompt_ids, sampling, seed=config.run.seed)
        scored, completions = reward_responses(data.tokenizer, data.rewards, examples, batch,
                                               samples)
        grammar = getattr(data.task, "grammar_ok", None)
        errors = error_token_metrics(batch.response_ids, batch.response_mask,
                                     batch.finish_reasons,
                                     grammar_ok=[grammar(c) for c in completions] if grammar else None)
        mask = batch.response_mask
        naive = policy.learner.replay(batch, sampling)[0]  # the full-precision learner
        fake_model = quantize_learner(copy.deepcopy(policy.learner.model),
                                      config.quant.model_copy(update={"align": "fake"}))
        fake = LocalEngine.from_tokenizer(fake_model, data.tokenizer).score(batch, sampling)
        budget = config.rollout.max_new_tokens
        tail = mask.clone()
        tail[:, : budget - budget // 4] = False  # the last quarter of the budget

        def gap(old: torch.Tensor, where: torch.Tensor) -> float | None:
            if not bool(where.any()):
                return None
            return round(float(((old - batch.rollout_logp).abs() * where).sum() / where.sum()), 4)

        result = {
            "candidate": name, "format": scheme, "rows": len(prompt_ids),
            **{k.split("/", 1)[1]: round(v, 4) for k, v in reward_metrics(scored).items()
               if k in ("reward/mean", "reward/accuracy")},
            "length_mean": round(float(mask.sum(1).float().mean()), 1),
            **{k: None if v != v else round(v, 4) for k, v in errors.items()},
            "lowprob_tokens": round(lowprob_tokens(naive, mask), 4),
            "naive_gap": gap(naive, mask), "naive_gap_last_quarter": gap(naive, tail),
            "fake_gap": gap(fake, mask), "fake_gap_last_quarter": gap(fake, tail),
            "naive_k3_kl": round(mismatch_metrics(naive, batch.rollout_logp, mask)["k3_kl"], 4),
        }
    return result


COLUMNS = ["candidate", "format", "accuracy", "length_mean", "truncated", "rep_ngram", "rep_run",
           "garbled", "lowprob_tokens", "naive_gap", "naive_gap_last_quarter", "fake_gap",
           "fake_gap_last_quarter"]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(c) is None else str(r.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CANDIDATES), default=None)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per candidate")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (T = 1)")
    parser.add_argument("--table", action="store_true", help="also print a markdown table")
    args = parser.parse_args()
    from qarl.native import machine
    from qarl.native.memory import tune_allocator

    tune_allocator()
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for name in args.only or CANDIDATES:
            for scheme in args.formats:
                rows.append(measure(name, CANDIDATES[name], scheme, args.prompts, args.samples, out))
                print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"machine": machine(), "prompts": args.prompts, "samples": args.samples,
                      "rows": rows}, indent=1))
    if args.table:
        print(markdown(rows))


if __name__ == "__main__":
    main()
