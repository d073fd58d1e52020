"""The policy: the model whose master weights are trained, and how its rollout copy is
quantized and the learner aligned to it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from qarl.config.section import CHECK, SPEED
from qarl.config.section import SECTION as _SECTION
from qarl.quant import ALIGNS


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
        "from them after every optimizer step). 'bfloat16' only for a run that trains nothing "
        "(it rounds small updates away); for bf16 speed set train.compute_dtype.",
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
    align: Literal[ALIGNS] = Field(
        "kernel",
        description="Learner forward: 'kernel' runs the rollout engine's low-bit kernel with a "
        "straight-through backward (QaRL), 'fake' emulates the quantizer in floating point, "
        "'naive' is the baseline without alignment (full-precision learner, quantized "
        "sampler). Has no effect when scheme = 'none': both sides then run full precision.",
    )

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
    contract_exempt: list[str] = Field(
        default_factory=list,
        description="Linear layers (names matched as in include) that may be quantized on one "
        "side only or differently: the quantization contract (docs/contract.md) lists them as "
        "exempt instead of stopping the run before step 1.",
        json_schema_extra=CHECK,
    )
    sync_check: bool = Field(
        True,
        description="After every weight sync, compare a digest (CRC-32 per tensor part) of what "
        "each engine replica holds with what the learner pushed; a difference stops the run "
        "naming the layers. Its cost is contract/seconds in a step's metrics.",
        json_schema_extra=CHECK,
    )
    sync_delta: Literal["auto"] | bool = Field(
        "auto",
        description="After the first weight push, send the engine only the codes and scales "
        "that changed since the version it holds (and every other tensor whole), in the "
        "smallest of three encodings per tensor; a whole push to a new or restarted engine, "
        "and where a delta would not be smaller. The engine's weights are the same bits "
        "either way (the per-sync digests check them). true needs a quantized scheme, an "
        "aligned learner (fake or kernel), rollout.engine = 'local' and no LoRA. 'auto': on "
        "where a push crosses machines (Ray rollout workers on other nodes than the learner); "
        "on one machine a whole push is a memory copy or a hand-over by reference, which the "
        "delta's encoding does not beat. docs/training.md, 'Weight sync'; measured by "
        "benchmarks/sync_delta.py.",
        json_schema_extra=SPEED,
    )
    over_budget: Literal["flag", "stop"] = Field(
        "flag",
        description="A step whose learner-vs-sampler mismatch exceeds the run's budget (0 "
        "where the replay is exact by construction; else budget_factor x the run's first "
        "step: docs/contract.md): 'flag' marks it (contract/over_budget) and logs when it "
        "starts and clears; 'stop' ends the run before that step's update.",
        json_schema_extra=CHECK,
    )
    budget_factor: float = Field(
        4.0, gt=1,
        description="Where the replay is not exact by construction (fake, naive, vLLM, MoE, "
        "CUDA), the mismatch budget is this multiple of the mean per-token mismatch the run's "
        "first step measured, when the engine held exactly the learner's starting weights.",
        json_schema_extra=CHECK,
    )
    routing_replay: bool = Field(False, description="MoE models: the learner uses the experts the "
        "engine chose for each token (its own router's probabilities weight them) in old_logp "
        "and the update (routing replay, R3). Needs a MoE model (qwen3_moe, mixtral).")

    @field_validator("align", mode="before")
    @classmethod
    def _renamed_align(cls, value: Any) -> Any:  # recipes written before the rename
        if value == "none":
            raise ValueError("'none' is now called 'naive' (full-precision learner, quantized "
                             "sampler); write align = \"naive\"")
        return value
