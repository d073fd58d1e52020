"""Held-out evaluation of the deployed (quantized) policy and of its full-precision weights.

With eval.cache_dir set, each policy's evaluation is kept there under the digest of what it
depends on (`eval_key`: the weights the engine serves, its kernels, the prompts, sampling,
seed, task, qarl's code and the machine), and an evaluation with the same digest is read
instead of run: the arms of a comparison that start from one warm start share their step-0
evaluation (`qarl compare` points its runs at one folder)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from functools import cache
from pathlib import Path

from qarl import jsonio
from qarl.algo.diagnostics import error_token_metrics
from qarl.config import EvalSection, RunConfig
from qarl.model import CausalLM
from qarl.model.loading import build_model
from qarl.lora.layers import lora_names, merged_weights
from qarl.rollout import LocalEngine
from qarl.train.phases import reward_metrics, reward_responses
from qarl.train.data import Data
from qarl.train.policy import Policy
from qarl.types import RolloutBatch, SamplingParams, concat_batches

EVAL_CHUNK = 64  # prompts per generate call: bounds the KV cache at eval time


def full_precision_copy(learner: CausalLM) -> CausalLM:
    """A plain CausalLM over the learner's master weights (no quantization anywhere); a LoRA
    learner's with each adapter merged into its layer's weight (W + (alpha / r) B A).

    Its parameters share the masters' storage instead of copying them (`build_model` assigns
    tensors already in its dtype and contiguous as they are): evaluation only reads them (its
    engine packs what it decodes with), and copying them would put one more fp32 copy of the
    weights on top of the optimizer state, making the run's final evaluation its peak
    (docs/training.md, "Memory")."""
    adapters = set(lora_names(learner))
    masters = {name: p.detach() for name, p in learner.named_parameters() if name not in adapters}
    masters.update(merged_weights(learner))
    dtype = learner.model.embed_tokens.weight.dtype
    plain = build_model(learner.config, masters, dtype, Path("the learner's master weights"))
    return plain.requires_grad_(False)


def eval_sampling(eval_cfg: EvalSection) -> SamplingParams:
    return SamplingParams(max_new_tokens=eval_cfg.max_new_tokens, temperature=eval_cfg.temperature,
                          top_p=eval_cfg.top_p, top_k=eval_cfg.top_k, min_p=eval_cfg.min_p,
                          greedy=eval_cfg.greedy)


def generate_all(engine: LocalEngine, prompt_ids: list[list[int]], sampling: SamplingParams,
                 seed: int) -> RolloutBatch:
    batches = [engine.generate(prompt_ids[i : i + EVAL_CHUNK], sampling, seed=seed + i)
               for i in range(0, len(prompt_ids), EVAL_CHUNK)]
    return concat_batches(batches, engine.pad_token_id)


@cache
def code_digest() -> str:
    """sha256 of every source file of the qarl package (Python and native kernels): a change
    to any of them may change an evaluation's bits."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in {".py", ".c", ".cpp", ".h"}):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def eval_key(engine: LocalEngine, prompt_ids: list[list[int]], sampling: SamplingParams,
             seed: int, config: RunConfig) -> str:
    """The digest of everything one policy's evaluation depends on: the engine's weights
    (`weight_digests`: every tensor, and the codes and scales a quantized layer decodes with,
    not the master weight such a layer may still hold),
    each quantized layer's kernel, its stop and pad ids and context, the prompts, sampling and
    seed, the task (its reward and grammar), qarl's code and the machine (ISA, threads, torch)."""
    from qarl.native import machine
    from qarl.quant.apply import quant_layers
    from qarl.quant.digests import CODES_SUFFIX

    held = engine.weight_digests()[0]
    # a quantized layer decodes with its codes: a master weight it still holds (a naive
    # learner's engine quantizes what it is sent) changes nothing it generates
    decoded = {k: v for k, v in held.items() if f"{k}{CODES_SUFFIX}" not in held}
    material = {
        "weights": decoded,
        "kernels": sorted({layer.kernel_path() for layer in quant_layers(engine.model).values()}),
        "engine": [engine.eos_token_ids, engine.pad_token_id, engine.max_context],
        "prompts": prompt_ids, "sampling": dataclasses.asdict(sampling), "seed": seed,
        "task": config.task.model_dump(mode="json"), "code": code_digest(), "machine": machine(),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


def _read_shared(path: Path | None) -> dict[str, float] | None:
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text())


def _write_shared(path: Path | None, metrics: dict[str, float]) -> None:
    """Atomically: a run that reads concurrently sees the whole file or none."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    part.write_text(jsonio.dumps(metrics, indent=1))
    os.replace(part, path)


def evaluate(policy: Policy, data: Data, config: RunConfig) -> dict[str, float]:
    """Accuracy and error-token rates on the eval examples: `eval/*_quantized` from the engine
    (the policy that is deployed), `eval/*_full_precision` from the master weights (unless
    eval.full_precision is false), and each one's seconds, `time/eval_*`; `eval/shared_*` = 1
    where eval.cache_dir held that evaluation (module docstring). Reads the recipe's eval,
    run.seed, task and model.max_context."""
    # the full-precision engine is built when its turn comes, after the deployed engine's
    # evaluation, whose packs a local engine drops first (`release_caches`; the next generate
    # rebuilds them): the two engines' packs are never held at once
    engines = {"quantized" if policy.quantized else "full_precision": lambda: policy.engine}
    if policy.quantized and config.eval.full_precision:
        engines["full_precision"] = lambda: LocalEngine.from_tokenizer(
            full_precision_copy(policy.learner.model), data.tokenizer,
            max_context=config.model.max_context)
    examples = data.eval_examples
    prompt_ids = data.prompts.encode_prompts(examples)
    metrics: dict[str, float] = {}
    grammar = getattr(data.task, "grammar_ok", None)
    sampling = eval_sampling(config.eval)
    for label, build in engines.items():
        began = time.perf_counter()
        engine = build()
        path = None
        if config.eval.cache_dir and isinstance(engine, LocalEngine):
            key = eval_key(engine, prompt_ids, sampling, config.run.seed, config)
            path = Path(config.eval.cache_dir) / f"{key}.json"
        shared = _read_shared(path)
        if shared is not None:
            metrics.update({f"eval/{k}_{label}": v for k, v in shared.items()})
            metrics[f"eval/shared_{label}"] = 1.0
            metrics[f"time/eval_{label}"] = time.perf_counter() - began
            continue
        own: dict[str, float] = {}
        batch = generate_all(engine, prompt_ids, sampling, seed=config.run.seed)
        result, completions = reward_responses(data.tokenizer, data.rewards, examples, batch,
                                               group_size=1)
        data.watch.observe(result, f"the {label.replace('_', '-')} evaluation")
        own.update({key.split("/", 1)[1]: value for key, value in reward_metrics(result).items()})
        verdicts = [grammar(c) for c in completions] if grammar else None
        own.update(error_token_metrics(batch.response_ids, batch.response_mask,
                                       batch.finish_reasons, grammar_ok=verdicts))
        _write_shared(path, own)
        metrics.update({f"eval/{k}_{label}": v for k, v in own.items()})
        metrics[f"time/eval_{label}"] = time.perf_counter() - began  # generate + score
        if len(engines) > 1 and engine is policy.engine and isinstance(engine, LocalEngine):
            engine.release_caches()  # before the full-precision engine packs its weights
    return metrics
