"""The recipe schema: one pydantic model per TOML section, every field described once.

The descriptions below are the only documentation of the options: `python -m qarl.config
--markdown` turns them into docs/config.md, and the CLI help points there. Checks that span
fields or sections live in `checks.py`; this file holds only types, defaults and ranges.

Optional fields default to None, meaning "derived" or "absent" (TOML has no null: a saved
config omits it); `load_config` fills the derived ones (run.name, eval.size, eval.temperature,
eval.max_new_tokens).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qarl.config.compare_schema import CompareSection
from qarl.config.dist_schema import DistSection

# Strict: a recipe is typed TOML ("32" is not an int; an int is accepted as a float).
_SECTION = ConfigDict(extra="forbid", strict=True, frozen=True)


class RunSection(BaseModel):
    """Where the run lives and how it starts. The run folder is `output_dir/name`."""

    model_config = _SECTION

    name: str | None = Field(None, min_length=1, description="Run name and folder name under "
        "output_dir. Default: the recipe file's stem (recipes/default.toml -> 'default'). "
        "Letters, digits, '.', '_' and '-' only.")
    output_dir: str = Field("runs", min_length=1, description="Folder that holds run folders.")
    seed: int = Field(0, ge=0, description="Seed for sampling, data order and initialization.")
    resume: bool = Field(
        True,
        description="Resume from the last checkpoint in the run folder if there is one (the "
        "recipe must be the one it was saved with, save for train.steps, micro-batch, "
        "checkpoint and log settings); false starts from step 0 and clears the folder's "
        "checkpoints and metrics. `qarl train --resume RUN_DIR` resumes with the saved recipe.",
    )


class ModelSection(BaseModel):
    """The policy model: what to load and in which precision its master weights live."""

    model_config = _SECTION

    name: str = Field(
        "smollm2-135m",
        min_length=1,
        description="A zoo name (`qarl models` lists them: 'smollm2-135m', 'tiny') or a local "
        "Hugging Face folder / GGUF file. A relative path is resolved against the current "
        "directory and saved absolute.",
    )
    master_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Dtype of the trained master weights (the quantized rollout copy is derived "
        "from them after every optimizer step).",
    )
    max_context: int | None = Field(
        None,
        ge=1,
        description="Longest prompt + response the run may use, in tokens. Default: the "
        "model's own limit. When set, task.max_prompt_tokens + rollout/eval max_new_tokens "
        "must fit in it.",
    )


class QuantSection(BaseModel):
    """Rollout quantization and how the learner is aligned to it (method.md section 2)."""

    model_config = _SECTION

    scheme: str = Field(
        "w8a8-int8",
        min_length=1,
        description="Quantization scheme of the rollout model: a name from qarl.quant.SCHEMES, "
        "e.g. 'w8a8-int8', 'w8a8-fp8', 'w4a16-int4', or 'none' (full-precision rollouts).",
    )
    align: Literal["kernel", "fake", "naive"] = Field(
        "kernel",
        description="Learner forward: 'kernel' runs the rollout engine's low-bit kernel with a "
        "straight-through backward (QaRL), 'fake' emulates the quantizer in floating point, "
        "'naive' is the baseline without alignment (full-precision learner, quantized "
        "sampler). Has no effect when scheme = 'none': both sides then run full precision.",
    )

    @field_validator("align", mode="before")
    @classmethod
    def _renamed_align(cls, value: Any) -> Any:
        if value == "none":
            raise ValueError("'none' is now called 'naive' (full-precision learner, quantized "
                             "sampler); write align = \"naive\"")
        return value

    include: list[str] | None = Field(
        None,
        description="Only quantize linear layers whose name contains one of these strings, or "
        "matches one as a glob when it holds '*', '?' or '[' (e.g. ['q_proj', 'k_proj'] or "
        "['model.layers.1*']). Default: every linear inside the decoder blocks "
        "('model.layers.*'), so not the lm_head; a MoE router ('mlp.gate') only when a "
        "pattern ending in 'mlp.gate' names it.",
    )
    exclude: list[str] | None = Field(
        None,
        description="Never quantize linear layers whose name contains (or, as a glob, matches) "
        "one of these strings; applied after include.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options passed to the scheme, e.g. {group_size = 64} for "
        "w4a16-int4. Names are checked against the scheme.",
    )
    routing_replay: bool = Field(False, description="MoE models: the learner uses the experts the "
        "engine chose for each token (its own router's probabilities weight them) in old_logp "
        "and the update (routing replay, R3). Needs a MoE model (qwen3_moe, mixtral).")


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
    engine: Literal["local", "vllm"] = Field("local", description="Rollout engine: 'local' "
        "(qarl's own) or 'vllm' (vLLM in this process, fed qarl's codes in compressed-tensors "
        "layout after every step; needs quant.align 'fake' or 'naive' and `pip install "
        "'qarl[vllm]'`, see qarl/rollout/README.md).")


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
    reward_workers: int = Field(2, ge=1, description="Worker processes that compute rewards.")
    eval_size: int = Field(200, ge=1, description="Held-out prompts for evaluation.")
    max_prompt_tokens: int = Field(
        256, ge=1, description="Prompts longer than this (after templating) are an error."
    )


class OverlongSection(BaseModel):
    """DAPO overlong reward shaping: a linear penalty over the last l_cache tokens before l_max."""

    model_config = _SECTION

    l_max: int = Field(..., ge=1, description="Length (tokens) at which the penalty reaches -1.")
    l_cache: int = Field(
        ..., ge=1, description="Width of the penalty ramp: it starts at l_max - l_cache."
    )


class AlgoSection(BaseModel):
    """The policy-gradient objective (method.md sections 3 and 4)."""

    model_config = _SECTION

    loss: str = Field(
        "tbpo",
        min_length=1,
        description="Policy loss, a name from qarl.algo.LOSSES: 'tbpo', 'grpo', 'dr_grpo', "
        "'dapo', 'gspo', 'dual_clip'.",
    )
    loss_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword parameters of the loss (e.g. {eps_high = 4e-4} for tbpo); missing "
        "ones take the loss's defaults (qarl/algo/README.md lists them). Names are checked "
        "against the loss.",
    )
    correction: str | None = Field(
        None,
        min_length=1,
        description="Rollout correction applied on top of the loss, a name from "
        "qarl.algo.CORRECTIONS (e.g. 'tis_token'). Default: none.",
    )
    correction_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword parameters of the correction (e.g. {cap = 2.0}).",
    )
    advantage: Literal["grpo", "dr_grpo"] = Field(
        "grpo",
        description="Group advantage over the group's scorable rewards: 'grpo' = (r - mean) / "
        "(std + 1e-6) with the unbiased std, 'dr_grpo' = r - mean.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic-sampling filter, without resampling: the rows of groups whose "
        "rewards are all equal (advantage 0) are masked out of the update, so they do not count "
        "in the loss's token / sequence denominators. No extra responses are sampled: the step "
        "trains on the remaining rows (metric groups/kept_frac).",
    )
    overlong: OverlongSection | None = Field(
        None, description="DAPO overlong shaping as {l_max, l_cache}. Default: off."
    )
    epochs: int = Field(
        1, ge=1, description="Optimizer passes over each rollout batch (K); 1 = on-policy."
    )
    aggregation: str | None = Field(
        None,
        min_length=1,
        description="How token losses are reduced to a scalar, a name from "
        "qarl.algo.AGGREGATIONS (e.g. 'token-mean', 'seq-mean-token-mean'). Default: the "
        "loss's own.",
    )


class TrainSection(BaseModel):
    """Optimization: steps, batch split, optimizer, schedule, checkpoints."""

    model_config = _SECTION

    steps: int = Field(..., ge=1, description="Optimizer steps (one rollout batch each).")
    micro_batch_size: int = Field(
        8,
        ge=1,
        description="Sequences per forward/backward pass; rollout.batch_size must be a multiple "
        "of it (groups may span micro-batches).",
    )
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="'adamw', or 'muon' (torch.optim.Muon on 2-D weight matrices, AdamW on the "
        "rest).",
    )
    lr: float = Field(
        ...,
        ge=0,
        description="Peak learning rate. 0 is a dry run: every phase runs, the weights (and so "
        "the engine's codes) never change.",
    )
    min_lr: float = Field(
        0.0, ge=0, description="Floor of the cosine/linear decay; at most lr."
    )
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Decay after warmup: to min_lr at the last step, or none."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Linear warmup to lr over this many steps (step i, from 0, uses "
        "lr * (i + 1) / warmup_steps); at most steps."
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    betas: list[float] = Field(
        default_factory=lambda: [0.9, 0.999],
        min_length=2,
        max_length=2,
        description="AdamW (beta1, beta2), each in [0, 1).",
    )
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 = off.")
    checkpoint_every: int = Field(
        0, ge=0, description="Save a checkpoint every this many steps; 0 = only at the end."
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="Most recent checkpoints kept in the run folder."
    )
    max_bad_steps: int = Field(
        3, ge=1, description="Abort after this many steps in a row whose loss or gradient was "
        "not finite (each such step is skipped: weights and optimizer state untouched)."
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


class SftSection(BaseModel):
    """Optional supervised warm start on the task's reference answers, before RL."""

    model_config = _SECTION

    steps: int = Field(0, ge=0, description="SFT optimizer steps; 0 = no warm start.")
    lr: float = Field(1e-3, gt=0, description="SFT learning rate (constant, AdamW).")
    batch_size: int = Field(16, ge=1, description="Prompt + answer sequences per SFT step.")


class LogSection(BaseModel):
    """Where metrics go. A metrics.jsonl line per step is what plots and reports read."""

    model_config = _SECTION

    progress: bool = Field(True, description="Show a progress bar with the main metrics.")
    tensorboard: Literal["auto"] | bool = Field(
        "auto",
        description="Write TensorBoard events: 'auto' = only if tensorboard is installed; "
        "true = required (an error if it is not installed).",
    )
    plot: bool = Field(
        True, description="Write curves.png, plots of the metrics, at the end of the run (read "
        "from metrics.jsonl, so only with jsonl = true)."
    )
    jsonl: bool = Field(True, description="Write metrics.jsonl in the run folder.")


class RunConfig(BaseModel):
    """A whole recipe. Sections may be omitted from a TOML file; their defaults apply."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    quant: QuantSection = Field(default_factory=QuantSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    task: TaskSection = Field(default_factory=TaskSection)
    algo: AlgoSection = Field(default_factory=AlgoSection)
    train: TrainSection
    eval: EvalSection = Field(default_factory=EvalSection)
    sft: SftSection = Field(default_factory=SftSection)
    log: LogSection = Field(default_factory=LogSection)
    dist: DistSection = Field(default_factory=DistSection)
    compare: CompareSection | None = None  # optional: None when the recipe has no [compare]


# section name -> model, in recipe order; the loader validates each on its own so that
# problems in one section do not hide problems in another.
SECTIONS: dict[str, type[BaseModel]] = {
    **{name: field.annotation for name, field in RunConfig.model_fields.items()},
    "compare": CompareSection,
}
# Sections that stay None when the recipe leaves them out (no defaults filled in).
OPTIONAL_SECTIONS = frozenset({"compare"})
