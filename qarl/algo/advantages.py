"""Group-relative advantages (GRPO, Dr.GRPO) and DAPO's overlong reward shaping.

Rows come in groups of `group_size` consecutive samples of the same prompt. A reward of None
(NaN in a tensor) means the sample could not be scored: it is left out of its group's mean and
std and gets advantage 0, so it neither pulls the baseline nor receives a gradient.
A group whose scorable rewards are all equal (including a group with at most one scorable
sample) carries no learning signal: all its advantages are 0 and `info.all_equal` marks it,
so DAPO's dynamic sampling can drop it (`info.keep`).

Group statistics are float64: rewards that differ in their last float32 digits (10, 10.001,
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

ADVANTAGE_MODES = ("grpo", "dr_grpo")


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


def group_advantages(
    rewards: Sequence[float | None] | Tensor,  # N rewards; None / NaN = unscorable
    group_size: int,
    mode: str = "grpo",
    eps: float = 1e-6,
) -> tuple[Tensor, GroupInfo]:  # advantages [N] float32
    """GRPO: A = (r − mean_g) / (std_g + eps); Dr.GRPO: A = r − mean_g (no std scaling).
    Group statistics use the scorable samples only; std is the unbiased (n − 1) estimate."""
    if mode not in ADVANTAGE_MODES:
        raise UnknownNameError(
            f"unknown advantage mode {mode!r}; valid names: {', '.join(sorted(ADVANTAGE_MODES))}"
        )
    r = _as_tensor(rewards)  # [N]
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D ([N]), got shape {tuple(r.shape)}")
    if group_size < 1 or r.numel() % group_size:
        raise ValueError(
            f"group_size must be >= 1 and divide the number of rewards; got group_size="
            f"{group_size} for {r.numel()} rewards"
        )
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    groups = r.view(-1, group_size)  # [G, K]
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
    spread = lowest != highest  # [G] bool
    all_equal = ~spread | (n < 2)  # [G] bool
    if mode == "grpo":
        # A = (r − mean_g) / (std_g + eps)
        adv = centered / (std[:, None] + eps)  # [G, K]
    else:
        # A = r − mean_g
        adv = centered  # [G, K]
    adv = torch.where(all_equal[:, None], torch.zeros_like(adv), adv)  # [G, K]
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
