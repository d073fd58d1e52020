"""What is sampled and how it is scored: rollouts and the evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from qarl.config.section import SPEED
from qarl.config.section import SECTION as _SECTION
from qarl.rollout.engines import ENGINES
from qarl.rollout.vllm_support import VLLM_DTYPES


class RolloutSection(BaseModel):
    """Sampling of training responses: G responses per prompt, batch_size responses per step."""

    model_config = _SECTION

    group_size: int = Field(
        8, ge=2, description="Responses sampled per prompt (G); advantages are normalized in the "
        "group, so at least 2."
    )
    batch_size: int = Field(
        32,
        ge=2,
        description="Responses per optimizer step (all groups together); a multiple of "
        "group_size and of train.micro_batch_size.",
    )
    max_new_tokens: int = Field(32, ge=1, description="Longest response in tokens.")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; the learner scores tokens at the same one."
    )
    top_p: float = Field(
        1.0, gt=0, le=1,
        description="Nucleus sampling: keep the most likely tokens up to this mass; 1 = off. "
        "With any truncation (top_p, top_k, min_p) the sampler records what it kept at each "
        "position and the learner scores under the same truncated distribution "
        "(rollout.truncation_correction).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    min_p: float = Field(
        0.0, ge=0, lt=1, description="Keep the tokens at least min_p times as likely as the "
        "most likely one; 0 = off. Applied after top_k and top_p.")
    truncation_correction: bool = Field(
        True, description="With truncated sampling, the learner's logprobs (replay, audit and "
        "gradient) are taken over the tokens the sampler kept, renormalized, so the policy "
        "trained is the one sampled (docs/learner.md#truncated-sampling). false: over the whole "
        "vocabulary, the biased ratio of learners that ignore truncation (its mean is the kept "
        "probability mass); for comparison only. qarl's own engine records kept sets; with "
        "rollout.engine = 'vllm' set it to false or do not truncate.")
    engine: Literal[tuple(ENGINES)] = Field("local", description="Rollout engine: 'local' "
        "(qarl's own) or 'vllm' (vLLM in this process, fed qarl's codes in compressed-tensors "
        "layout after every step; needs quant.align 'fake' or 'naive' and `pip install "
        "'qarl[vllm]'`, see qarl/rollout/README.md).")
    vllm_dtype: Literal[VLLM_DTYPES] = Field("auto", description="What vLLM computes in "
        "(rollout.engine = 'vllm'): 'auto' = float32, the learner's precision, where vLLM's "
        "kernels take it, else bfloat16 (a bfloat16 master; an int8 scheme on x86 CPUs with "
        "AMX, whose vLLM int8 kernel takes only 16-bit activations); or 'float32' / "
        "'bfloat16'. benchmarks/vllm_int8_gap.py measures the mismatch of each.")


class EvalSection(BaseModel):
    """Held-out evaluation of the deployed (quantized) policy, and optionally the master one."""

    model_config = _SECTION

    every: int = Field(
        0, ge=0, description="Evaluate every this many steps; 0 = only before and after training."
    )
    size: int | None = Field(
        None, ge=1, description="Prompts evaluated. Default: task.eval_size."
    )
    greedy: bool = Field(True, description="Greedy decoding; false samples at eval.temperature.")
    temperature: float | None = Field(
        None, gt=0, description="Sampling temperature when greedy = false. Default: "
        "rollout.temperature."
    )
    max_new_tokens: int | None = Field(
        None, ge=1, description="Longest response. Default: rollout.max_new_tokens."
    )
    top_p: float | None = Field(
        None, gt=0, le=1, description="Nucleus mass when greedy = false. Default: rollout.top_p.")
    top_k: int | None = Field(
        None, ge=0, description="Top-k when greedy = false. Default: rollout.top_k.")
    min_p: float | None = Field(
        None, ge=0, lt=1, description="Min-p when greedy = false. Default: rollout.min_p.")
    full_precision: bool = Field(
        True,
        description="Also evaluate the unquantized master weights (the gap shows what "
        "quantization costs the trained policy).",
    )
    cache_dir: str = Field(
        "", description="A folder that keeps each evaluation under the digest of what it "
        "depends on (the weights the engine serves and its kernels, the prompts, sampling, "
        "seed, task, qarl's code, the machine); an evaluation with the same digest is read from "
        "it instead of run, and logged as eval/shared_* = 1. `qarl compare` sets it to "
        "FOLDER/eval-cache for its runs, so arms that start from one warm start evaluate step 0 "
        "once per seed. Empty: every evaluation runs. qarl's own engine only.",
        json_schema_extra=SPEED)
