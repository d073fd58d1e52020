"""Held-out evaluation of the deployed (quantized) policy and of its full-precision weights."""

from __future__ import annotations

import time

from qarl.algo.diagnostics import error_token_metrics
from qarl.config import EvalSection, RunConfig
from qarl.model import CausalLM
from qarl.quant.lora import lora_names, merged_weights
from qarl.rollout import LocalEngine
from qarl.train.phases import reward_metrics, reward_responses
from qarl.train.setup import Data, Policy
from qarl.types import RolloutBatch, SamplingParams, concat_batches

EVAL_CHUNK = 64  # prompts per generate call: bounds the KV cache at eval time


def full_precision_copy(learner: CausalLM) -> CausalLM:
    """A plain CausalLM holding the learner's master weights (no quantization anywhere); a
    LoRA learner's with each adapter merged into its layer's weight (W + (alpha / r) B A)."""
    weight = learner.model.embed_tokens.weight
    plain = CausalLM(learner.config).to(device=weight.device, dtype=weight.dtype)
    adapters = set(lora_names(learner))
    masters = {name: p.detach() for name, p in learner.named_parameters() if name not in adapters}
    masters.update(merged_weights(learner))
    missing, unexpected = plain.load_state_dict(masters, strict=False)
    missing = [n for n in missing if not (n == "lm_head.weight" and learner.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"master weights do not map onto the plain model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return plain.eval()


def eval_sampling(eval_cfg: EvalSection) -> SamplingParams:
    return SamplingParams(max_new_tokens=eval_cfg.max_new_tokens, temperature=eval_cfg.temperature,
                          greedy=eval_cfg.greedy)


def generate_all(engine: LocalEngine, prompt_ids: list[list[int]], sampling: SamplingParams,
                 seed: int) -> RolloutBatch:
    batches = [engine.generate(prompt_ids[i : i + EVAL_CHUNK], sampling, seed=seed + i)
               for i in range(0, len(prompt_ids), EVAL_CHUNK)]
    return concat_batches(batches, engine.pad_token_id)


def evaluate(policy: Policy, data: Data, config: RunConfig) -> dict[str, float]:
    """Accuracy and error-token rates on the eval examples: `eval/*_quantized` from the engine
    (the policy that is deployed), `eval/*_full_precision` from the master weights (unless
    eval.full_precision is false), and each one's seconds, `time/eval_*`. Reads the recipe's
    eval, run.seed and model.max_context."""
    engines = {"quantized" if policy.quantized else "full_precision": policy.engine}
    if policy.quantized and config.eval.full_precision:
        engines["full_precision"] = LocalEngine.from_tokenizer(
            full_precision_copy(policy.learner.model), data.tokenizer, max_context=config.model.max_context)
    examples = data.eval_examples
    prompt_ids = data.prompts.encode_prompts(examples)
    metrics: dict[str, float] = {}
    grammar = getattr(data.task, "grammar_ok", None)
    for label, engine in engines.items():
        began = time.perf_counter()
        batch = generate_all(engine, prompt_ids, eval_sampling(config.eval), seed=config.run.seed)
        result, completions = reward_responses(data.tokenizer, data.rewards, examples, batch,
                                               group_size=1)
        for key, value in reward_metrics(result).items():
            metrics[f"eval/{key.split('/', 1)[1]}_{label}"] = value
        verdicts = [grammar(c) for c in completions] if grammar else None
        errors = error_token_metrics(batch.response_ids, batch.response_mask, batch.finish_reasons,
                                     grammar_ok=verdicts)
        metrics.update({f"eval/{k}_{label}": v for k, v in errors.items()})
        metrics[f"time/eval_{label}"] = time.perf_counter() - began  # generate + score
    return metrics
