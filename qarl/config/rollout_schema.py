"""What is sampled and from what: rollouts, the task and its reward, the evaluation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from qarl.config.section import CHECK, SPEED
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
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling mass. Below 1 the sampler's distribution is truncated and "
        "differs from the learner's by design (mismatch that alignment cannot remove).",
    )
    top_k: int = Field(0, ge=0, description="Top-k truncation; 0 = off. Same caveat as top_p.")
    engine: Literal[tuple(ENGINES)] = Field("local", description="Rollout engine: 'local' "
        "(qarl's own) or 'vllm' (vLLM in this process, fed qarl's codes in compressed-tensors "
        "layout after every step; needs quant.align 'fake' or 'naive' and `pip install "
        "'qarl[vllm]'`, see qarl/rollout/README.md).")
    vllm_dtype: Literal[VLLM_DTYPES] = Field("auto", description="What vLLM computes in "
        "(rollout.engine = 'vllm'): 'auto' = float32, the learner's precision, where vLLM's "
        "kernels take it, else bfloat16 (a bfloat16 master; an int8 scheme on x86 CPUs with "
        "AMX, whose vLLM int8 kernel takes only 16-bit activations); or 'float32' / "
        "'bfloat16'. benchmarks/vllm_int8_gap.py measures the mismatch of each.")


class TaskSection(BaseModel):
    """What the model is trained on: a built-in task or a dataset file, and its reward."""

    model_config = _SECTION

    name: str | None = Field(
        None,
        min_length=1,
        description="A built-in task from qarl.tasks.TASKS (e.g. 'addition'). Set exactly one "
        "of name and dataset.",
    )
    dataset: str | None = Field(
        None,
        min_length=1,
        description="Path to a .jsonl or .parquet file of prompts (and answers). Relative to "
        "the current directory; saved absolute. Set exactly one of name and dataset.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of the task, e.g. {digits = 1} for 'addition'; with a "
        "dataset, options of the 'dataset' task (e.g. {eval_fraction = 0.1}). Names are "
        "checked against the task.",
    )
    reward: str | None = Field(
        None,
        min_length=1,
        description="Reward: a built-in name from qarl.tasks.REWARDS (e.g. 'math_answer') or "
        "'module:function', called as (prompt, completion, **fields) -> float | None. "
        "Default: the task's own verifier.",
    )
    system_prompt: str | None = Field(
        None, description="System message of every prompt that has none of its own (a dataset "
        "row's 'system' column wins); without a chat template it is prepended as plain text and "
        "a blank line. Default: none."
    )
    chat_template: bool = Field(
        True, description="Wrap prompts in the tokenizer's chat template (if it has one); "
        "otherwise a prompt is encoded as plain text."
    )
    reward_timeout_s: float = Field(
        10.0, gt=0, description="Deadline per reward call; a timeout is counted, never a 0."
    )
    reward_workers: int = Field(2, ge=1, description="Worker processes that compute rewards.",
                                json_schema_extra=SPEED)
    reward_error_warn: float = Field(
        0.1, ge=0, le=1, description="Warn when more than this fraction of a step's (or an "
        "evaluation's) reward calls fail (an error or a timeout: each scores None, never 0); "
        "the warning is logged when it starts and when it clears, and each distinct error is "
        "kept in the run folder's reward_errors.txt. Every call of the run's first batch "
        "failing stops the run (exit status 2).", json_schema_extra=CHECK)
    eval_size: int = Field(200, ge=1, description="Held-out prompts for evaluation.")
    max_prompt_tokens: int = Field(
        256, ge=1, description="Prompts longer than this (after templating) are an error."
    )


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
