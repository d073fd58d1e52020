"""Token-level PPO-clip losses: grpo, dr_grpo, dapo, dual_clip.

All four share one per-token objective with ratio r_t = π_θ(y_t) / π_old(y_t):

    ℓ_t = max( −r_t·A , −clip(r_t, 1−ε_l, 1+ε_h)·A )            (PPO clip)
    ℓ_t = min( ℓ_t , −c·A )   for A < 0                         (dual clip only)

and differ only in their clip widths and aggregation defaults: each is a `TokenClipLoss`
holding its defaults. A clipped token has zero gradient:
for A > 0 once r > 1+ε_h, for A < 0 once r < 1−ε_l, and with dual clip for A < 0 once r > c.
`rollout_logp` is unused here: mismatch between π_old and the sampler is handled by a rollout
correction (`qarl.algo.corrections`) passed in as `is_weights` and a mask.

Common keyword arguments (every loss in `qarl.algo` takes them):
    aggregation  one of `qarl.algo.AGGREGATIONS`; the default differs per loss
    norm_len     the constant of seq-mean-token-sum-norm (pass max_new_tokens)
    is_weights   [N, L] float or None: per-token weights (a rollout correction), no gradient
    num_tokens, num_seqs   whole-step counts for micro-batch invariance (see aggregation.py)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qarl.algo.aggregation import aggregate
from qarl.algo.common import (
    approx_kl,
    as_valid,
    bounded_exp,
    frac,
    masked_log_ratio,
    stats,
)
from qarl.algo.params import check_params


def ppo_clip_loss(
    logp: Tensor,  # [N, L] float, learner logprobs (with grad)
    old_logp: Tensor,  # [N, L] float, learner logprobs at rollout time (no grad)
    rollout_logp: Tensor,  # [N, L] float, sampler logprobs (unused by this loss)
    advantages: Tensor,  # [N] float
    mask: Tensor,  # [N, L] bool or 0/1 float
    *,
    eps_low: float,
    eps_high: float,
    clip_c: float | None,
    aggregation: str,
    norm_len: int | None,
    is_weights: Tensor | None,
    num_tokens: Tensor | float | int | None,
    num_seqs: Tensor | float | int | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The shared token-level PPO objective; `clip_c=None` disables the dual clip."""
    valid = as_valid(mask)  # [N, L] bool
    log_ratio = masked_log_ratio(logp, old_logp.detach(), valid)  # [N, L]
    ratio = bounded_exp(log_ratio)  # [N, L]
    adv = advantages.detach().to(logp.dtype)[:, None]  # [N, 1]
    # ℓ = max( −r·A , −clip(r, 1−ε_l, 1+ε_h)·A )
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    pos, neg = (adv > 0).expand_as(valid) & valid, (adv < 0).expand_as(valid) & valid
    clipped = (pos & (ratio > 1.0 + eps_high)) | (neg & (ratio < 1.0 - eps_low))  # [N, L]
    metrics: dict[str, Tensor] = {}
    if clip_c is not None:
        # A < 0:  ℓ = min( ℓ , −c·A )
        per_token = torch.where(neg, torch.minimum(per_token, -clip_c * adv), per_token)
        dual = neg & (ratio > clip_c)  # [N, L]
        metrics["dual_clip_frac"] = frac(dual, neg)
        clipped = clipped | dual
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    loss = aggregate(per_token, valid, aggregation, num_tokens, num_seqs, norm_len)
    metrics.update(
        clip_frac=frac(clipped, valid),
        clip_frac_pos=frac(clipped, pos),
        clip_frac_neg=frac(clipped, neg),
        approx_kl=approx_kl(logp, old_logp, valid),
        **stats("ratio", ratio, valid),
    )
    return loss, metrics


@dataclass(frozen=True)
class TokenClipLoss:
    """One loss of the family: `ppo_clip_loss` with its own defaults (the parameters a recipe
    may set, read from `__signature__` like any loss function's keyword-only arguments)."""

    name: str
    eps_low: float
    eps_high: float
    aggregation: str
    clip_c: float | None = None  # None: no dual clip (and no clip_c parameter)
    about: str = ""  # what the loss is, with its source

    def defaults(self) -> dict[str, Any]:
        extra = {} if self.clip_c is None else {"clip_c": self.clip_c}
        return {"eps_low": self.eps_low, "eps_high": self.eps_high, **extra,
                "aggregation": self.aggregation, "norm_len": None}

    @property
    def __signature__(self) -> inspect.Signature:
        positional = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                      for n in ("logp", "old_logp", "rollout_logp", "advantages", "mask")]
        keyword = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=v)
                   for n, v in {**self.defaults(), "is_weights": None, "num_tokens": None,
                                "num_seqs": None}.items()]
        return inspect.Signature(positional + keyword)

    def __call__(self, logp: Tensor, old_logp: Tensor, rollout_logp: Tensor,
                 advantages: Tensor, mask: Tensor, *, is_weights: Tensor | None = None,
                 num_tokens: Tensor | float | int | None = None,
                 num_seqs: Tensor | float | int | None = None,
                 **params: Any) -> tuple[Tensor, dict[str, Tensor]]:
        defaults = self.defaults()
        unknown = sorted(set(params) - set(defaults))
        if unknown:
            raise TypeError(f"{self.name} got unexpected keyword arguments {unknown}; it takes "
                            f"{sorted(defaults)}")
        full = {**defaults, **params}
        check_params(self.name, **full)
        return ppo_clip_loss(logp, old_logp, rollout_logp, advantages, mask,
                             is_weights=is_weights, num_tokens=num_tokens, num_seqs=num_seqs,
                             **{"clip_c": None, **full})


grpo_loss = TokenClipLoss(
    "grpo", eps_low=0.2, eps_high=0.2, aggregation="seq-mean-token-mean",
    about="GRPO (Shao et al. 2024): token PPO clip ε = 0.2, mean over tokens then sequences.")

dr_grpo_loss = TokenClipLoss(
    "dr_grpo", eps_low=0.2, eps_high=0.2, aggregation="seq-mean-token-sum-norm",
    about="Dr.GRPO (Liu et al. 2025): token sum over a constant length, no per-response "
            "length normalization (pair it with `group_advantages(mode=\"dr_grpo\")`, no std "
            "scaling).")

dapo_loss = TokenClipLoss(
    "dapo", eps_low=0.2, eps_high=0.28, aggregation="token-mean",
    about="DAPO (Yu et al. 2025): clip-higher (0.2 / 0.28) and a token mean over the batch. "
            "Dynamic sampling and overlong shaping live in `qarl.algo.advantages`.")

dual_clip_loss = TokenClipLoss(
    "dual_clip", eps_low=0.2, eps_high=0.2, aggregation="seq-mean-token-mean", clip_c=3.0,
    about="Dual-clip PPO (Ye et al. 2020): for A < 0 the loss is also capped at −c·A, c = 3, "
            "so a token whose ratio exploded cannot push without bound. Aggregated like GRPO.")
