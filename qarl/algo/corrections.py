"""Rollout corrections: importance weights and rejection masks for the π_old / π_μ mismatch.

    c = CORRECTIONS[name](old_logp, rollout_logp, mask, advantages=None, logp=None, **params)
    loss, m = LOSSES[loss_name](logp, old_logp, rollout_logp, adv, mask * c.mask,
                                is_weights=c.weights, ...)

How a correction composes with any loss: its `weights` multiply the per-token loss (passed as
`is_weights`, never differentiated) and its `mask` replaces the loss mask, so rejected tokens
and sequences leave the aggregation denominators too. Corrections read only tensors known
before the optimizer step (old_logp, rollout_logp, advantages), so they are computed once on
the whole step's batch, before `global_counts` and the split into micro-batches. `compose`
stacks several (weights and masks multiply). TBPO already applies its own capped sequence
weight and trust band; a correction added to TBPO stacks on top of them (allowed; e.g. `opsm`
or `mis_token` on top of TBPO; `tis_seq` on top of TBPO weights the mismatch twice).

With r = π_old / π_μ per token (log-ratios are clamped to ±20 before exp):

    tis_token  w_t = min(r_t, cap)                                  (FlashRL, cap 2)
    tis_seq    w_i = min(ρ_i, cap), ρ_i = exp(mean_t log r) (form="geometric") or Π_t r_t
    mis_token  keep token if low ≤ r_t ≤ high, w_t = r_t on kept tokens
    mis_seq    keep sequence if low ≤ Π_t r_t ≤ high, w_i = Π_t r_t on kept sequences
    geo_mask   keep sequence if low ≤ exp(mean_t log r) ≤ high, w = 1
    opsm       drop sequence if A_i < 0 and mean_t log(π_μ / π_θ) > delta, w = 1

Metrics (0-d detached tensors): ratio_mean/min/max of the raw ratio before truncation or
rejection (over tokens for token-level corrections, over sequences otherwise), masked_frac
(fraction of those units removed), clipped_frac (TIS: fraction above cap) and ess, the
normalized effective sample size (Σw)² / (n·Σw²) of the final weights over the kept units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from qarl.algo.common import (
    Registry,
    as_valid,
    bounded_exp,
    frac,
    masked_log_ratio,
    seq_mean,
    stats,
)
from qarl.algo.params import check_params, keyword_defaults, validate_params


@dataclass(frozen=True)
class Correction:
    """The output of a rollout correction (see the module docstring)."""

    weights: Tensor  # [N, L] float32, no grad; sequence weights repeated on tokens; 0 off-mask
    mask: Tensor  # [N, L] float32 0/1: the input mask minus rejected tokens and sequences
    metrics: dict[str, Tensor]  # 0-d detached float32 tensors


def _ess(weights: Tensor, among: Tensor) -> Tensor:  # [] float32
    """(Σw)² / (n·Σw²) over `among`: 1 for equal weights, 1/n when one weight dominates."""
    w = torch.where(among, weights.float(), torch.zeros((), device=weights.device))
    n = among.float().sum()
    return (w.sum() ** 2 / (n * (w**2).sum()).clamp_min(1e-30)).where(n > 0, n.new_ones(()))


def _finish(
    valid: Tensor,  # [N, L] bool, input mask
    weights: Tensor,  # [N, L] float
    keep: Tensor,  # [N, L] bool, tokens kept by this correction
    ratio: Tensor,  # [N, L] or [N], raw ratio per unit
    units_valid: Tensor,  # same shape as ratio, bool: units that hold tokens
    units_kept: Tensor,  # same shape as ratio, bool
    unit_weights: Tensor,  # same shape as ratio, final weight per unit
    extra: dict[str, Tensor] | None = None,
) -> Correction:
    out_mask = valid & keep  # [N, L] bool
    metrics = {
        **stats("ratio", ratio, units_valid),
        "masked_frac": frac(~units_kept, units_valid),
        "ess": _ess(unit_weights, units_kept & units_valid),
        **(extra or {}),
    }
    zero = torch.zeros((), dtype=torch.float32, device=weights.device)
    return Correction(
        weights=torch.where(out_mask, weights.detach().float(), zero),
        mask=out_mask.float(),
        metrics=metrics,
    )


def _token_ratio(old_logp: Tensor, rollout_logp: Tensor, valid: Tensor) -> Tensor:  # [N, L]
    return bounded_exp(masked_log_ratio(old_logp.detach(), rollout_logp.detach(), valid).float())


def _seq_ratio(old_logp: Tensor, rollout_logp: Tensor, valid: Tensor, form: str) -> Tensor:  # [N]
    log_r = masked_log_ratio(old_logp.detach(), rollout_logp.detach(), valid).float()  # [N, L]
    # geometric: ρ_i = exp(mean_t log r_t);  product: ρ_i = exp(Σ_t log r_t) = Π_t r_t
    return bounded_exp(seq_mean(log_r, valid) if form == "geometric" else log_r.sum(dim=1))


def _sequence_band(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, form: str,
                   low: float, high: float, weighted: bool) -> Correction:
    """Reject the sequences whose ratio ρ_i (`form`: geometric or product) leaves [low, high];
    the kept ones weigh ρ_i (`weighted`) or 1."""
    valid = as_valid(mask)  # [N, L] bool
    has_tokens = valid.any(dim=1)  # [N]
    rho = _seq_ratio(old_logp, rollout_logp, valid, form)  # [N]
    # keep_i = 1[low ≤ ρ_i ≤ high]
    keep = (rho >= low) & (rho <= high)  # [N]
    w = rho if weighted else torch.ones_like(rho)  # [N]
    w_tok = w[:, None].expand(valid.shape)  # [N, L]
    return _finish(valid, w_tok, keep[:, None], rho, has_tokens, keep & has_tokens, w)


def tis_token(
    old_logp: Tensor,  # [N, L] float
    rollout_logp: Tensor,  # [N, L] float
    mask: Tensor,  # [N, L] bool or 0/1
    advantages: Tensor | None = None,  # [N] float
    logp: Tensor | None = None,  # [N, L] float
    *,
    cap: float = 2.0,
) -> Correction:
    """Token TIS: w_t = min(π_old/π_μ, cap); nothing masked."""
    check_params("tis_token", cap=cap)
    valid = as_valid(mask)  # [N, L] bool
    r = _token_ratio(old_logp, rollout_logp, valid)  # [N, L]
    # w_t = min(r_t, cap)
    w = r.clamp(max=cap)  # [N, L]
    extra = {"clipped_frac": frac(r > cap, valid)}
    return _finish(valid, w, valid, r, valid, valid, w, extra)


def tis_seq(
    old_logp: Tensor,  # [N, L] float
    rollout_logp: Tensor,  # [N, L] float
    mask: Tensor,  # [N, L] bool or 0/1
    advantages: Tensor | None = None,  # [N] float
    logp: Tensor | None = None,  # [N, L] float
    *,
    cap: float = 2.0,
    form: str = "geometric",
) -> Correction:
    """Sequence TIS: w_i = min(ρ_i, cap), ρ_i geometric-mean (length-safe) or product form."""
    check_params("tis_seq", cap=cap, form=form)
    valid = as_valid(mask)  # [N, L] bool
    has_tokens = valid.any(dim=1)  # [N]
    rho = _seq_ratio(old_logp, rollout_logp, valid, form)  # [N]
    # w_i = min(ρ_i, cap)
    w = rho.clamp(max=cap)  # [N]
    extra = {"clipped_frac": frac(rho > cap, has_tokens)}
    w_tok = w[:, None].expand(valid.shape)  # [N, L]
    return _finish(valid, w_tok, valid, rho, has_tokens, has_tokens, w, extra)


def mis_token(
    old_logp: Tensor,  # [N, L] float
    rollout_logp: Tensor,  # [N, L] float
    mask: Tensor,  # [N, L] bool or 0/1
    advantages: Tensor | None = None,  # [N] float
    logp: Tensor | None = None,  # [N, L] float
    *,
    low: float = 0.5,
    high: float = 2.0,
) -> Correction:
    """Token masked IS: reject tokens whose r_t leaves [low, high]; w_t = r_t on the others."""
    check_params("mis_token", low=low, high=high)
    valid = as_valid(mask)  # [N, L] bool
    r = _token_ratio(old_logp, rollout_logp, valid)  # [N, L]
    # keep_t = 1[low ≤ r_t ≤ high]
    keep = (r >= low) & (r <= high)  # [N, L]
    return _finish(valid, r, keep, r, valid, keep & valid, r)


def mis_seq(
    old_logp: Tensor,  # [N, L] float
    rollout_logp: Tensor,  # [N, L] float
    mask: Tensor,  # [N, L] bool or 0/1
    advantages: Tensor | None = None,  # [N] float
    logp: Tensor | None = None,  # [N, L] float
    *,
    low: float = 0.5,
    high: float = 2.0,
) -> Correction:
    """Sequence masked IS (product form): reject sequences whose Π_t r_t leaves [low, high]."""
    check_params("mis_seq", low=low, high=high)
    return _sequence_band(old_logp, rollout_logp, mask, "product", low, high, weighted=True)


def geo_mask(
    old_logp: Tensor,  # [N, L] float
    rollout_logp: Tensor,  # [N, L] float
    mask: Tensor,  # [N, L] bool or 0/1
    advantages: Tensor | None = None,  # [N] float
    logp: Tensor | None = None,  # [N, L] float
    *,
    low: float = 0.999,
    high: float = 1.001,
) -> Correction:
    """Geometric-mean rejection: drop sequences whose exp(mean_t log r) leaves [low, high]."""
    check_params("geo_mask", low=low, high=high)
    return _sequence_band(old_logp, rollout_logp, mask, "geometric", low, high, weighted=False)


def opsm(
    old_logp: Tensor,  # [N, L] float
    rollout_logp: Tensor,  # [N, L] float
    mask: Tensor,  # [N, L] bool or 0/1
    advantages: Tensor | None = None,  # [N] float
    logp: Tensor | None = None,  # [N, L] float
    *,
    delta: float = 1e-4,
) -> Correction:
    """Off-policy sequence masking (DeepSeek-V3.2): drop a negative-advantage sequence whose
    mean_t log(π_μ / π_θ) exceeds delta. π_θ is `logp` when given (detached), else `old_logp`
    (equal at the first step on a batch; using old_logp keeps the mask known before the
    optimizer step, which micro-batch invariance needs).
    Reported ratio: exp(mean_t log(π_θ / π_μ))."""
    check_params("opsm", delta=delta)
    if advantages is None:
        raise ValueError("opsm needs `advantages` ([N] float): it only drops sequences with A < 0")
    valid = as_valid(mask)  # [N, L] bool
    has_tokens = valid.any(dim=1)  # [N]
    policy = old_logp if logp is None else logp
    # d_i = mean_t [logp_μ − logp_θ]
    d = seq_mean(masked_log_ratio(rollout_logp.detach(), policy.detach(), valid).float(), valid)
    # keep_i = not (A_i < 0 and d_i > δ)
    keep = ~((advantages.detach() < 0) & (d > delta))  # [N]
    ones = torch.ones_like(d)  # [N]
    w_tok = ones[:, None].expand(valid.shape)  # [N, L]
    ratio = bounded_exp(-d)  # [N]
    return _finish(valid, w_tok, keep[:, None], ratio, has_tokens, keep & has_tokens, ones)


CORRECTIONS = Registry(
    "correction",
    {
        "tis_token": tis_token,
        "tis_seq": tis_seq,
        "mis_token": mis_token,
        "mis_seq": mis_seq,
        "geo_mask": geo_mask,
        "opsm": opsm,
    },
)


def correction_params(name: str) -> dict[str, Any]:
    """The parameters a recipe may set for correction `name`, with their defaults."""
    return keyword_defaults(CORRECTIONS[name])


def validate_correction_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The full parameter dict for correction `name`, or one ValueError with every problem."""
    return validate_params(CORRECTIONS, name, params)


def compose(corrections: Mapping[str, Correction], mask: Tensor) -> Correction:
    """Stack corrections: weights and masks multiply; metrics become `{name}/{key}`. With no
    correction: weights 1 on `mask`, the mask itself, no metrics."""
    valid = as_valid(mask)  # [N, L] bool
    weights, out_mask = valid.float(), valid.float()  # [N, L], [N, L]
    metrics: dict[str, Tensor] = {}
    for name, c in corrections.items():
        weights = weights * c.weights
        out_mask = out_mask * c.mask
        metrics.update({f"{name}/{k}": v for k, v in c.metrics.items()})
    return Correction(weights=weights, mask=out_mask, metrics=metrics)


def apply_corrections(
    specs: Mapping[str, Mapping[str, Any]],  # {correction name: its params}, in order
    old_logp: Tensor,  # [N, L] float
    rollout_logp: Tensor,  # [N, L] float
    mask: Tensor,  # [N, L] bool or 0/1
    advantages: Tensor | None = None,  # [N] float, needed by opsm
    logp: Tensor | None = None,  # [N, L] float, optional for opsm
) -> Correction:
    """Run each named correction on the same inputs and `compose` the results."""
    results = {
        name: CORRECTIONS[name](old_logp, rollout_logp, mask, advantages, logp, **params)
        for name, params in specs.items()
    }
    return compose(results, mask)
