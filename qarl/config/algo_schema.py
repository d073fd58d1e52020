"""The policy-gradient objective: loss, correction, advantages (method.md sections 3-4)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from qarl.algo import ADVANTAGE_MODES, KL_ESTIMATORS
from qarl.config.section import SECTION as _SECTION


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
    advantage: Literal[ADVANTAGE_MODES] = Field(
        "grpo",
        description="Advantage estimator over the scorable rewards (formulas in "
        "qarl/algo/README.md): 'grpo' = (r - mean) / (std + 1e-6) in the group, unbiased std; "
        "'dr_grpo' = r - mean; 'rloo' = r minus the mean of the group's other samples; "
        "'reinforce_pp' = r whitened over the batch, each response weighted by its tokens "
        "(verl's REINFORCE++); 'reinforce_pp_baseline' = r - group mean, then whitened the "
        "same way. Groups whose rewards are all equal get 0, except under 'reinforce_pp' "
        "without dynamic_sampling (no group baseline: such a group still differs from the "
        "batch mean).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic-sampling filter, without resampling: the rows of groups whose "
        "rewards are all equal (advantage 0) are masked out of the update, so they do not count "
        "in the loss's token / sequence denominators (and, under advantage 'reinforce_pp', not "
        "in its batch statistics). No extra responses are sampled: the step trains on the "
        "remaining rows (metric groups/kept_frac).",
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
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of a KL term to the reference policy (the policy at "
        "step 0, frozen; docs/learner.md#the-reference-policy), TRL's beta; 0 = off (no "
        "reference is built).")
    kl_estimator: Literal[KL_ESTIMATORS] = Field(
        "k3", description="Per-token KL estimate, as verl's kl_penalty defines them: 'k1' = "
        "logp - ref_logp, 'abs' = |k1|, 'k2' = k1^2 / 2 (verl's 'mse'), 'k3' = exp(-k1) + k1 - "
        "1 (verl's 'low_var_kl', clamped to 10).")
    kl_in: Literal["loss", "reward"] = Field(
        "loss", description="Where the KL term goes: 'loss' adds kl_coef x the token-mean KL of "
        "each optimizer step's mini-batch to the loss (verl's use_kl_loss, TRL's beta); "
        "'reward' subtracts kl_coef x each response's summed KL (old_logp against the "
        "reference) from its reward before the advantages (verl's use_kl_in_reward, summed "
        "per sequence).")
