"""Outcome advantages (GRPO, Dr.GRPO, RLOO, REINFORCE++, REINFORCE++-baseline) and DAPO's
overlong reward shaping.

Rows come in groups of `group_size` consecutive samples of the same prompt. A reward of None
(NaN in a tensor) means the sample could not be scored: it is left out of every statistic and
gets advantage 0, so it neither pulls a baseline nor receives a gradient.
A group whose scorable rewards are all equal (including a group with at most one scorable
sample) is marked in `info.all_equal`, and `info.keep` leaves its rows out: what DAPO's
dynamic sampling drops. For the group-baseline modes (grpo, dr_grpo, rloo,
reinforce_pp_baseline) such a group carries no learning signal and its advantages are 0.
reinforce_pp has no group baseline: a group of equal rewards is above or below the batch mean
and keeps its advantage, unless `drop_all_equal` takes it out of the batch first.

The REINFORCE++ modes whiten over the whole batch weighted by tokens, as verl's masked_whiten
over the response tokens does: with one outcome reward and γ = 1 every token of response i
carries the same return, so sample i counts L_i times. They need `lengths`.

Statistics are float64: rewards that differ in their last float32 digits (10, 10.001,
10.0005, 9.9995) would lose most of their spread to float32 rounding (7e-4 relative error
in the advantage); the advantages are float32 (what the losses take).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from qarl.algo.common import UnknownNameError

ADVANTAGE_MODES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
# Modes whose statistics span the batch, weighted by response tokens (they need `lengths`).
BATCH_MODES = ("reinforce_pp", "reinforce_pp_baseline")
# Default eps per mode: GRPO adds it to the std; the batch modes add verl's masked_whiten
# constant to the variance, inside the square root. dr_grpo and rloo divide by nothing.
DEFAULT_EPS = {"grpo": 1e-6, "reinforce_pp": 1e-8, "reinforce_pp_baseline": 1e-8}


@dataclass(frozen=True)
class GroupInfo:
    """What `group_advantages` learned about each group and sample."""

    all_equal: Tensor  # [G] bool, groups with no spread in their scorable rewards
    scorable: Tensor  # [N] bool, samples with a reward (not None / NaN)
    keep: Tensor  # [N] bool, samples of groups that are not all_equal (dynamic sampling)
    mean: Tensor  # [G] float64, mean of the scorable rewards (0 when none)
    std: Tensor  # [G] float64, unbiased std of the scorable rewards (0 when fewer than 2)


def _as_tensor(rewards: Sequence[float | None] | Tensor) -> Tensor:  # [N] float64
    if isinstance(rewards, Tensor):
        return rewards.detach().double()
    return torch.tensor([math.nan if r is None else float(r) for r in rewards], dtype=torch.float64)


def _check(r: Tensor, group_size: int, mode: str, eps: float | None,
           lengths: Tensor | Sequence[int] | None) -> Tensor | None:  # lengths [N] float64
    """Raise on a bad argument (every problem at once); return the lengths as float64."""
    if mode not in ADVANTAGE_MODES:
        raise UnknownNameError(
            f"unknown advantage mode {mode!r}; valid names: {', '.join(sorted(ADVANTAGE_MODES))}"
        )
    problems = []
    if r.dim() != 1:
        problems.append(f"rewards must be 1-D ([N]), got shape {tuple(r.shape)}")
    elif group_size < 1 or r.numel() % group_size:
        problems.append(f"group_size must be >= 1 and divide the number of rewards; got "
                        f"group_size={group_size} for {r.numel()} rewards")
    if eps is not None and not eps >= 0:
        problems.append(f"eps must be >= 0, got {eps}")
    length = None
    if lengths is not None:
        length = torch.as_tensor(lengths).to(device=r.device, dtype=torch.float64)  # [N]
        if tuple(length.shape) != tuple(r.shape) or bool((length < 0).any()):
            problems.append(f"lengths must be [N] token counts >= 0 like the rewards "
                            f"{tuple(r.shape)}; got shape {tuple(length.shape)}")
    elif mode in BATCH_MODES:
        problems.append(f"mode {mode!r} weights the batch statistics by response tokens: pass "
                        "lengths ([N] token counts of the responses)")
    if problems:
        raise ValueError("invalid group_advantages arguments: " + "; ".join(problems))
    return length


def _group_statistics(groups: Tensor) -> tuple[Tensor, ...]:
    """Per group of `groups` [G, K] float64 (NaN = unscorable): scorable [G, K] bool, n [G],
    values [G, K] (0 where unscorable), mean [G], centered [G, K] (r − mean_g, 0 where
    unscorable), std [G] (unbiased), all_equal [G] bool."""
    scorable = ~torch.isnan(groups)  # [G, K]
    n = scorable.sum(dim=1).double()  # [G]
    values = torch.where(scorable, groups, torch.zeros_like(groups))  # [G, K]
    # mean_g = Σ_k r / n_g
    mean = values.sum(dim=1) / n.clamp_min(1.0)  # [G]
    centered = torch.where(scorable, groups - mean[:, None], torch.zeros_like(groups))  # [G, K]
    # std_g = sqrt( Σ_k (r − mean_g)² / (n_g − 1) )
    std = torch.sqrt((centered**2).sum(dim=1) / (n - 1.0).clamp_min(1.0))  # [G]
    big = torch.tensor(math.inf)
    lowest = torch.where(scorable, groups, big).amin(dim=1)  # [G]
    highest = torch.where(scorable, groups, -big).amax(dim=1)  # [G]
    all_equal = (lowest == highest) | (n < 2)  # [G] bool
    return scorable, n, values, mean, centered, std, all_equal


def _token_whiten(values: Tensor, weights: Tensor, eps: float) -> Tensor:  # [G, K] float64
    """verl's masked_whiten of a per-sample value repeated on each of its tokens: `weights`
    [G, K] is each sample's token count, 0 for a sample outside the statistics."""
    counted = weights > 0  # [G, K]
    v = torch.where(counted, values, torch.zeros_like(values))  # [G, K], NaN-free
    tokens = weights.sum()  # T = Σ_i L_i
    # μ = Σ_i L_i·v_i / T
    mu = (weights * v).sum() / tokens.clamp_min(1.0)
    # σ² = Σ_i L_i·(v_i − μ)² / (T − 1)   (verl's masked_var: unbiased over the T tokens)
    var = (weights * (v - mu) ** 2).sum() / (tokens - 1.0).clamp_min(1.0)
    # A_i = (v_i − μ) / sqrt(σ² + eps)
    return torch.where(counted, (v - mu) / torch.sqrt(var + eps), torch.zeros_like(v))


def group_advantages(
    rewards: Sequence[float | None] | Tensor,  # N rewards; None / NaN = unscorable
    group_size: int,
    mode: str = "grpo",
    eps: float | None = None,
    lengths: Tensor | Sequence[int] | None = None,  # [N] response tokens; batch modes only
    drop_all_equal: bool = False,
) -> tuple[Tensor, GroupInfo]:  # advantages [N] float32
    """Advantages of `mode` (formulas below and in qarl/algo/README.md); group statistics use
    the scorable samples only, std is the unbiased (n − 1) estimate. `eps` None takes the
    mode's DEFAULT_EPS. `drop_all_equal` (dynamic sampling) takes the all-equal groups out of
    the batch before reinforce_pp's statistics, as verl filters groups before computing
    advantages; the other modes give those groups 0 and leave them out of every statistic
    already."""
    r = _as_tensor(rewards)  # [N]
    length = _check(r, group_size, mode, eps, lengths)  # [N] float64 or None
    eps = DEFAULT_EPS.get(mode, 0.0) if eps is None else eps
    groups = r.view(-1, group_size)  # [G, K]
    scorable, n, values, mean, centered, std, all_equal = _group_statistics(groups)
    # reinforce_pp keeps an all-equal group (its signal is its distance to the batch mean)
    # unless dynamic sampling drops it; every other mode zeroes it.
    keeps_all_equal = mode == "reinforce_pp" and not drop_all_equal
    zeroed = torch.zeros_like(all_equal) if keeps_all_equal else all_equal  # [G] bool
    if mode == "grpo":
        # A = (r − mean_g) / (std_g + eps)
        adv = centered / (std[:, None] + eps)  # [G, K]
    elif mode == "dr_grpo":
        # A = r − mean_g
        adv = centered  # [G, K]
    elif mode == "rloo":
        # A_i = r_i − Σ_{j≠i} r_j / (n_g − 1) = n_g / (n_g − 1) · (r_i − mean_g)
        adv = centered * (n / (n - 1.0).clamp_min(1.0))[:, None]  # [G, K]
    else:
        # reinforce_pp: v_i = r_i; reinforce_pp_baseline: v_i = r_i − mean_g;
        # then A_i = (v_i − μ) / sqrt(σ² + eps), μ and σ² over the batch's tokens
        counted = scorable & ~zeroed[:, None]  # [G, K]
        weights = torch.where(counted, length.view_as(groups), torch.zeros_like(groups))
        adv = _token_whiten(values if mode == "reinforce_pp" else centered, weights, eps)
    adv = torch.where(zeroed[:, None], torch.zeros_like(adv), adv)  # [G, K]
    info = GroupInfo(
        all_equal=all_equal,
        scorable=scorable.reshape(-1),
        keep=(~all_equal)[:, None].expand_as(groups).reshape(-1),
        mean=mean,
        std=torch.where(n >= 2, std, torch.zeros_like(std)),
    )
    return adv.reshape(-1).float(), info


def overlong_penalty(
    lengths: Tensor | Sequence[int],  # [N] response lengths in tokens
    l_max: int,
    l_cache: int,
) -> Tensor:  # [N] float32, added to the task reward
    """DAPO soft overlong punishment:
         0                              if L ≤ L_max − L_cache
         (L_max − L_cache − L) / L_cache  if L_max − L_cache < L ≤ L_max
         −1                             if L > L_max"""
    problems = []
    if not isinstance(l_max, int) or l_max < 1:
        problems.append(f"l_max must be a positive int (the length budget), got {l_max!r}")
    if not isinstance(l_cache, int) or not 0 <= l_cache <= (l_max if isinstance(l_max, int) else 0):
        problems.append(f"l_cache must be an int in [0, l_max], got {l_cache!r}")
    if problems:
        raise ValueError("invalid overlong_penalty arguments: " + "; ".join(problems))
    length = torch.as_tensor(lengths).float()  # [N]
    start = float(l_max - l_cache)
    # (L_max − L_cache − L) / L_cache inside the soft zone
    ramp = (start - length) / max(l_cache, 1)  # [N]
    penalty = torch.where(length <= start, torch.zeros_like(length), ramp)
    return torch.where(length > l_max, torch.full_like(length, -1.0), penalty)
