"""Sequence-level losses: gspo and tbpo (the QaRL method's Trust-Band Policy Optimization).

Both use the length-safe GSPO ratio, a geometric mean over the response's tokens:

    s_i = exp( mean_t [logp_θ − logp_old] )

Repeating every token of a response leaves s_i unchanged, where a product of token ratios
would square. The sequence loss ℓ_i is repeated on each of the row's tokens, so with the
default seq-mean-token-mean aggregation the loss is mean_i ℓ_i; token-mean weights each
sequence by its length instead. Common keyword arguments as in `losses_ppo`.

Token-level weights (`is_weights` from a token correction such as `tis_token`) multiply the
repeated ℓ_i token by token, so under seq-mean-token-mean a row's loss is ℓ_i · mean_t w_it:
the weights act on a sequence loss as their row mean (tested). That is the choice here, by
design: a sequence ratio has one value per row and no token to give its own weight to.
verl's GSPO-token variant instead puts each token's weight on a per-token copy of s_i
(sg(s_i) · π_θ(y_t) / sg(π_θ(y_t))), which gives the same value and a different gradient;
qarl does not implement it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qarl.algo.aggregation import aggregate
from qarl.algo.common import (
    approx_kl,
    as_valid,
    bounded_exp,
    frac,
    masked_log_ratio,
    seq_mean,
    stats,
)
from qarl.algo.params import check_params


def sequence_ratio(logp: Tensor, old_logp: Tensor, valid: Tensor) -> Tensor:  # [N]
    """s_i = exp( mean_t [logp − old_logp] ) over the valid tokens (1 for an empty row)."""
    return bounded_exp(seq_mean(masked_log_ratio(logp, old_logp, valid), valid))


def tbpo_band(
    old_logp: Tensor,  # [N, L] float, learner logprobs at rollout time
    rollout_logp: Tensor,  # [N, L] float, sampler logprobs
    valid: Tensor,  # [N, L] bool
    band_low: float,
    band_high: float,
) -> tuple[Tensor, Tensor]:
    """(ρ [N], k [N] bool): the sequence mismatch and whether it lies inside the trust band."""
    # ρ_i = exp( mean_t [logp_old − logp_μ] )
    rho = sequence_ratio(old_logp.detach(), rollout_logp.detach(), valid)  # [N]
    # k_i = 1[ ρ_lo ≤ ρ_i ≤ ρ_hi ]
    keep = (rho >= band_low) & (rho <= band_high)  # [N] bool; NaN falls outside
    return rho, keep


def _broadcast(per_seq: Tensor, like: Tensor) -> Tensor:  # [N] -> [N, L]
    return per_seq[:, None].expand_as(like)


def gspo_loss(
    logp: Tensor,  # [N, L] float, learner logprobs (with grad)
    old_logp: Tensor,  # [N, L] float, learner logprobs at rollout time (no grad)
    rollout_logp: Tensor,  # [N, L] float, sampler logprobs (unused by this loss)
    advantages: Tensor,  # [N] float
    mask: Tensor,  # [N, L] bool or 0/1 float
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    aggregation: str = "seq-mean-token-mean",
    norm_len: int | None = None,
    is_weights: Tensor | None = None,
    num_tokens: Tensor | float | int | None = None,
    num_seqs: Tensor | float | int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): PPO clip on the geometric-mean sequence ratio, 3e-4 / 4e-4."""
    check_params(
        "gspo", eps_low=eps_low, eps_high=eps_high, aggregation=aggregation, norm_len=norm_len
    )
    valid = as_valid(mask)  # [N, L] bool
    has_tokens = valid.any(dim=1)  # [N] bool
    s = sequence_ratio(logp, old_logp.detach(), valid)  # [N]
    adv = advantages.detach().to(s.dtype)  # [N]
    # ℓ_i = max( −s_i·A_i , −clip(s_i, 1−ε_l, 1+ε_h)·A_i )
    per_seq = torch.maximum(-adv * s, -adv * s.clamp(1.0 - eps_low, 1.0 + eps_high))  # [N]
    per_token = _broadcast(per_seq, valid)  # [N, L]
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    loss = aggregate(per_token, valid, aggregation, num_tokens, num_seqs, norm_len)
    pos, neg = has_tokens & (adv > 0), has_tokens & (adv < 0)
    clipped = (pos & (s > 1.0 + eps_high)) | (neg & (s < 1.0 - eps_low))  # [N] bool
    return loss, {
        "clip_frac": frac(clipped, has_tokens),
        "clip_frac_pos": frac(clipped, pos),
        "clip_frac_neg": frac(clipped, neg),
        "approx_kl": approx_kl(logp, old_logp, valid),
        **stats("seq_ratio", s, has_tokens),
    }


def tbpo_loss(
    logp: Tensor,  # [N, L] float, learner logprobs (aligned forward, with grad)
    old_logp: Tensor,  # [N, L] float, learner logprobs at rollout time (no grad)
    rollout_logp: Tensor,  # [N, L] float, sampler logprobs reported by the engine
    advantages: Tensor,  # [N] float
    mask: Tensor,  # [N, L] bool or 0/1 float
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    neg_eps_low: float = 3e-4,
    neg_eps_high: float = 7e-4,
    is_cap: float = 2.0,
    band_low: float = 0.5,
    band_high: float = 2.0,
    aggregation: str = "seq-mean-token-mean",
    norm_len: int | None = None,
    is_weights: Tensor | None = None,
    num_tokens: Tensor | float | int | None = None,
    num_seqs: Tensor | float | int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """TBPO (method.md §3): GSPO ratio, a band-limited clip for negative advantages, a capped
    sequence IS weight for the π_old / π_μ mismatch, and a trust band that drops whole
    sequences whose mismatch leaves [band_low, band_high]. Dropped sequences leave the
    denominator too: L = Σ_i k_i·w_i·ℓ_i / max(1, Σ_i k_i) with the default aggregation.
    With micro-batches pass `num_seqs = Σ k_i` of the whole step (`qarl.algo.global_counts`).
    A rollout correction passed as `is_weights` multiplies on top of w_i (it stacks)."""
    check_params(
        "tbpo", eps_low=eps_low, eps_high=eps_high, neg_eps_low=neg_eps_low,
        neg_eps_high=neg_eps_high, is_cap=is_cap, band_low=band_low, band_high=band_high,
        aggregation=aggregation, norm_len=norm_len,
    )
    valid = as_valid(mask)  # [N, L] bool
    has_tokens = valid.any(dim=1)  # [N] bool
    rho, band = tbpo_band(old_logp, rollout_logp, valid, band_low, band_high)  # [N], [N]
    kept = has_tokens & band  # [N] bool
    # w_i = sg( min(ρ_i, C) ); 0 on dropped rows so a NaN ρ cannot reach the gradient
    w = torch.where(kept, rho.clamp(max=is_cap), 0.0).to(logp.dtype)  # [N], no grad
    # s_i = exp( mean_t [logp_θ − logp_old] )
    s = sequence_ratio(logp, old_logp.detach(), valid)  # [N]
    adv = advantages.detach().to(s.dtype)  # [N]
    # A ≥ 0:  ℓ_i = max( −s_i·A_i , −clip(s_i, 1−ε_l, 1+ε_h)·A_i )
    loss_pos = torch.maximum(-adv * s, -adv * s.clamp(1.0 - eps_low, 1.0 + eps_high))  # [N]
    # A < 0:  ℓ_i = −clip(s_i, 1−ε_l⁻, 1+ε_h⁻)·A_i   (no gradient outside it, on either side)
    loss_neg = -adv * s.clamp(1.0 - neg_eps_low, 1.0 + neg_eps_high)  # [N]
    per_seq = w * torch.where(adv >= 0, loss_pos, loss_neg)  # [N]
    per_token = _broadcast(per_seq, valid)  # [N, L]
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    # k_i: a dropped sequence leaves numerator and denominator alike
    counted = valid & kept[:, None]  # [N, L] bool
    loss = aggregate(per_token, counted, aggregation, num_tokens, num_seqs, norm_len)
    pos, neg = kept & (adv > 0), kept & (adv < 0)
    clipped_pos = pos & (s > 1.0 + eps_high)
    clipped_neg = neg & ((s < 1.0 - neg_eps_low) | (s > 1.0 + neg_eps_high))
    return loss, {
        "band_drop_frac": frac(~band, has_tokens),
        "clip_frac": frac(clipped_pos | clipped_neg, kept),
        "clip_frac_pos": frac(clipped_pos, pos),
        "clip_frac_neg": frac(clipped_neg, neg),
        "approx_kl": approx_kl(logp, old_logp, valid),
        **stats("seq_ratio", s, kept),
        **stats("mismatch_ratio", rho, has_tokens),
        **stats("mismatch_weight", w, kept),
    }


def tbpo_kept_rows(old_logp: Tensor, rollout_logp: Tensor, valid: Tensor, *, band_low: float,
                   band_high: float, **params) -> Tensor:  # [N] bool
    """The rows TBPO counts: those inside its trust band (`global_counts` asks a loss that
    drops whole rows itself for them, through the loss's `kept_rows`)."""
    return tbpo_band(old_logp, rollout_logp, valid, band_low, band_high)[1]


tbpo_loss.kept_rows = tbpo_kept_rows
