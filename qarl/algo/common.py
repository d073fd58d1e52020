"""Shared pieces of `qarl.algo`: name registries, parameter validation, masked reductions.

Parameter names mean the same thing in every loss and correction (`eps_low` is always the
lower clip width, `cap` always an upper truncation), so one table of rules (`PARAM_RULES`)
validates all of them. The accepted parameters of a function and their defaults are read from
its keyword-only signature: the code is the single source of truth.

Metrics everywhere in `qarl.algo` are a `dict[str, Tensor]` of 0-d detached float32 tensors
(no GPU sync inside the math); `metrics_to_floats` turns one dict into plain floats with one
sync, for the JSONL sink.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

# exp() of a log-ratio is taken after clamping to this bound (exp(20) ~ 4.9e8): a ratio of
# 1e300 carries no more information than 5e8 and would turn into inf, then NaN, downstream.
LOG_RATIO_BOUND = 20.0

# Keyword arguments of every loss that are supplied per call by the trainer, not by a recipe.
RUNTIME_KWARGS = ("is_weights", "num_tokens", "num_seqs")


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


def keyword_defaults(fn: Callable) -> dict[str, Any]:
    """The keyword-only parameters of `fn` that a recipe may set, with their defaults."""
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in RUNTIME_KWARGS
    }


def _non_negative(v: Any) -> str | None:
    if not isinstance(v, (int, float)) or not v >= 0 or math.isinf(v):
        return f"must be a finite number >= 0, got {v!r}"
    return None


def _clip_low(v: Any) -> str | None:
    if not isinstance(v, (int, float)) or not 0 <= v < 1:
        return f"must be in [0, 1) (the lower clip bound is 1 - eps), got {v!r}"
    return None


def _cap(v: Any) -> str | None:
    if not isinstance(v, (int, float)) or not v >= 1:
        return f"must be >= 1 (a cap below 1 shrinks every on-policy weight), got {v!r}"
    return None


def _clip_c(v: Any) -> str | None:
    if not isinstance(v, (int, float)) or not v > 1:
        return f"must be > 1 (Ye et al. 2020 use 3), got {v!r}"
    return None


def _positive_or_none(v: Any) -> str | None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        return f"must be a positive int (e.g. max_new_tokens) or None, got {v!r}"
    return None


def _form(v: Any) -> str | None:
    if v not in ("geometric", "product"):
        return f"must be 'geometric' or 'product', got {v!r}"
    return None


def _aggregation(v: Any) -> str | None:
    from qarl.algo.aggregation import AGGREGATIONS

    if v not in AGGREGATIONS:
        return f"must be one of {', '.join(sorted(AGGREGATIONS))}, got {v!r}"
    return None


# One rule per parameter name, shared by every loss and correction that accepts it.
PARAM_RULES: dict[str, Callable[[Any], str | None]] = {
    "eps_low": _clip_low,
    "eps_high": _non_negative,
    "neg_eps_low": _clip_low,
    "neg_eps_high": _non_negative,
    "clip_c": _clip_c,
    "is_cap": _cap,
    "cap": _cap,
    "band_low": _non_negative,
    "band_high": _non_negative,
    "low": _non_negative,
    "high": _non_negative,
    "delta": _non_negative,
    "form": _form,
    "aggregation": _aggregation,
    "norm_len": _positive_or_none,
}

# Pairs (lower, upper) that must satisfy lower <= upper when both are accepted.
ORDERED_PAIRS = (("band_low", "band_high"), ("low", "high"))


def param_problems(params: Mapping[str, Any]) -> list[str]:
    """Every problem with already-named parameters (no unknown-key check), as sentences."""
    problems = []
    for name, value in params.items():
        rule = PARAM_RULES.get(name)
        message = rule(value) if rule is not None else None
        if message:
            problems.append(f"{name} {message}")
    for lo, hi in ORDERED_PAIRS:
        if lo in params and hi in params:
            a, b = params[lo], params[hi]
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > b:
                problems.append(f"{lo} ({a}) must be <= {hi} ({b}); swap them")
    if "clip_c" in params and "eps_high" in params:
        c, eh = params["clip_c"], params["eps_high"]
        if isinstance(c, (int, float)) and isinstance(eh, (int, float)) and c <= 1 + eh:
            problems.append(
                f"clip_c ({c}) must be > 1 + eps_high ({1 + eh}), or the dual clip cuts "
                "inside the ordinary clip range"
            )
    return problems


def check_params(kind: str, **params: Any) -> None:
    """Raise one ValueError listing every problem with `params` (called by each function)."""
    problems = param_problems(params)
    if problems:
        raise ValueError(f"invalid {kind} parameters: " + "; ".join(problems))


def validate_params(registry: Registry, name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults of `registry[name]` updated with `params`; raises once with every problem."""
    fn = registry[name]
    accepted = keyword_defaults(fn)
    problems = [
        f"unknown parameter {key!r} for {registry.kind} {name!r}; accepted: "
        f"{', '.join(sorted(accepted)) or '(none)'}"
        for key in params
        if key not in accepted
    ]
    merged = {**accepted, **{k: v for k, v in params.items() if k in accepted}}
    problems += param_problems(merged)
    if problems:
        raise ValueError(f"invalid parameters for {registry.kind} {name!r}: " + "; ".join(problems))
    return merged


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
