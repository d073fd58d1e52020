"""Shared pieces of `qarl.algo`: name registries and masked reductions.

Metrics everywhere in `qarl.algo` are a `dict[str, Tensor]` of 0-d detached float32 tensors
(no GPU sync inside the math); `metrics_to_floats` turns one dict into plain floats with one
sync, for the JSONL sink. Parameter validation lives in `params.py`.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor

# exp() of a log-ratio is taken after clamping to this bound (exp(20) ~ 4.9e8): a ratio of
# 1e300 carries no more information than 5e8 and would turn into inf, then NaN, downstream.
LOG_RATIO_BOUND = 20.0


class UnknownNameError(KeyError, ValueError):
    """An unknown loss / correction / mode name. A KeyError (it is a registry lookup) and a
    ValueError (it is a bad setting), so either `except` catches it."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(dict):
    """A literal `{name: function}` table whose unknown keys raise with the sorted valid names."""

    def __init__(self, kind: str, entries: Mapping[str, Callable]):
        super().__init__(entries)
        self.kind = kind

    def __missing__(self, key: str):
        raise UnknownNameError(
            f"unknown {self.kind} {key!r}; valid names: {', '.join(sorted(self))}"
        )


def as_valid(mask: Tensor) -> Tensor:  # [N, L] bool
    """A 0/1 mask (bool or float) as bool. Fractional weights belong in `is_weights`."""
    return mask if mask.dtype == torch.bool else mask > 0


def masked_log_ratio(a: Tensor, b: Tensor, valid: Tensor) -> Tensor:  # [N, L]
    """a - b on valid positions, 0 elsewhere (padding may hold -inf or garbage)."""
    return torch.where(valid, a - b, torch.zeros((), dtype=a.dtype, device=a.device))


def seq_mean(x: Tensor, valid: Tensor) -> Tensor:  # [N]
    """mean_t x[i, t] over the valid tokens of each row (0 for a row with none)."""
    total = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=1)
    return total / valid.sum(dim=1).clamp_min(1).to(x.dtype)


def bounded_exp(log_ratio: Tensor) -> Tensor:
    """exp(clamp(log_ratio, -20, 20)): a ratio that cannot overflow."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def frac(hit: Tensor, among: Tensor) -> Tensor:  # 0-d float32
    """|hit & among| / max(1, |among|) for bool tensors of the same shape."""
    among_f = among.float()
    return ((hit & among).float().sum() / among_f.sum().clamp_min(1.0)).detach()


def stats(prefix: str, values: Tensor, among: Tensor) -> dict[str, Tensor]:
    """{prefix_mean, prefix_min, prefix_max} of `values` where `among` (bool); 0 when empty."""
    v = values.detach().float()
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    n = among.float().sum()
    mean = torch.where(among, v, zero).sum() / n.clamp_min(1.0)
    inf = torch.tensor(float("inf"), dtype=v.dtype, device=v.device)
    lo = torch.where(among, v, inf).min() if v.numel() else inf
    hi = torch.where(among, v, -inf).max() if v.numel() else -inf
    empty = n == 0
    return {
        f"{prefix}_mean": mean,
        f"{prefix}_min": torch.where(empty, zero, lo),
        f"{prefix}_max": torch.where(empty, zero, hi),
    }


def metrics_to_floats(metrics: Mapping[str, Tensor | float]) -> dict[str, float]:
    """Plain Python floats for logging, with a single device sync for the whole dict."""
    keys = list(metrics)
    device = next((v.device for v in metrics.values() if isinstance(v, Tensor)), None)
    tensors = [torch.as_tensor(metrics[k], dtype=torch.float32, device=device) for k in keys]
    values = torch.stack([t.detach().reshape(()) for t in tensors]).tolist() if tensors else []
    return dict(zip(keys, values))


def approx_kl(logp: Tensor, old_logp: Tensor, valid: Tensor) -> Tensor:  # [] float32
    """Token-mean k3 estimate of KL(π_old ‖ π_θ) on tokens sampled from π_old (Schulman)."""
    log_r = masked_log_ratio(logp.detach(), old_logp.detach(), valid).float()  # [N, L]
    # k3 = (r − 1) − log r,  r = π_θ / π_old ; always >= 0
    k3 = bounded_exp(log_r) - 1.0 - log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.where(valid, k3, torch.zeros_like(k3)).sum() / valid.sum().clamp_min(1).float()
