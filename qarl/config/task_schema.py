"""The task: where prompts come from, how they are templated, and the reward that scores them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from qarl.config.section import CHECK, SPEED
from qarl.config.section import SECTION as _SECTION


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
        description="Keyword options of the task, e.g. {digits = 1} for 'addition', or a "
        "reasoning-gym generator and its parameters for 'reasoning_gym' ({dataset = "
        "'chain_sum', max_terms = 3}; qarl/tasks/README.md); with a dataset, options of the "
        "'dataset' task (e.g. {eval_fraction = 0.1}). Names and values are checked against "
        "the task.",
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
    chat_template: bool | str = Field(
        True, description="true: wrap prompts in the tokenizer's chat template (if it has "
        "one, else plain text); false: encode a prompt as plain text; a string: a Jinja chat "
        "template (as transformers reads `chat_template`; text with a '{{' or '{%' tag) or the "
        "path of a file holding one (relative to the current directory; saved absolute), used "
        "instead of the tokenizer's. Responses still end at the tokenizer's end tokens."
    )
    reward_batch: bool = Field(
        False, description="The reward takes lists: one call per batch (a step's responses, "
        "an evaluation's) as (prompts, completions, **fields) with each field a list (None "
        "where a row lacks it), returning one float | None per completion; for vectorised "
        "scorers and model-based judges. Needs a 'module:function' task.reward. The call runs "
        "in one reward worker under task.reward_timeout_s; if it raises or times out, every "
        "completion of the batch gets that outcome."
    )
    reward_timeout_s: float = Field(
        10.0, gt=0, description="Deadline per reward call (with reward_batch: per batch); a "
        "timeout is counted, never a 0."
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
