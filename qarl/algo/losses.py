"""The loss registry, parameter discovery and validation, and whole-step counts.

    loss, metrics = LOSSES[name](logp, old_logp, rollout_logp, advantages, mask, **params)

`logp`, `old_logp`, `rollout_logp`: float [N, L] over response positions; `advantages`: [N];
`mask`: [N, L] bool or 0/1 float (1 on response tokens that count). `loss` is a 0-d tensor
with grad through `logp` only; `metrics` a dict of 0-d detached float32 tensors
(`metrics_to_floats` turns it into floats). The formulas are in losses_ppo.py / losses_seq.py
and in the table of qarl/algo/README.md.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor

from qarl.algo.aggregation import count_tokens_and_seqs
from qarl.algo.common import Registry, as_valid
from qarl.algo.losses_ppo import dapo_loss, dr_grpo_loss, dual_clip_loss, grpo_loss
from qarl.algo.losses_seq import gspo_loss, tbpo_loss
from qarl.algo.params import keyword_defaults, validate_params

LOSSES = Registry(
    "loss",
    {
        "grpo": grpo_loss,
        "dr_grpo": dr_grpo_loss,
        "dapo": dapo_loss,
        "gspo": gspo_loss,
        "dual_clip": dual_clip_loss,
        "tbpo": tbpo_loss,
    },
)


def loss_params(name: str) -> dict[str, Any]:
    """The parameters a recipe may set for loss `name`, with their defaults. The per-call
    arguments `is_weights`, `num_tokens`, `num_seqs` are not listed (the trainer passes them)."""
    return keyword_defaults(LOSSES[name])


def validate_loss_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The full parameter dict for loss `name` (defaults updated with `params`), or one
    ValueError listing every problem: unknown name, unknown keys, values that make no sense."""
    return validate_params(LOSSES, name, params)


def global_counts(
    name: str,
    old_logp: Tensor,  # [N, L] float, the whole optimizer step's batch
    rollout_logp: Tensor,  # [N, L] float
    mask: Tensor,  # [N, L] bool or 0/1, after rollout-correction masks are multiplied in
    **params: Any,
) -> dict[str, Tensor]:
    """{"num_tokens": T, "num_seqs": S} (0-d float32) that loss `name` would aggregate over
    on this whole batch: pass them to every micro-batch call for micro-batch invariance. A
    loss that removes whole sequences itself (TBPO's trust band) says which it keeps through
    its `kept_rows`; the others count `mask` as is."""
    full = validate_loss_params(name, params)
    valid = as_valid(mask)  # [N, L] bool
    kept_rows = getattr(LOSSES[name], "kept_rows", None)
    if kept_rows is not None:
        valid = valid & kept_rows(old_logp, rollout_logp, valid, **full)[:, None]
    tokens, seqs = count_tokens_and_seqs(valid)
    return {"num_tokens": tokens, "num_seqs": seqs}
