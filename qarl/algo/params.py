"""Parameter validation shared by every loss and correction of `qarl.algo`.

Parameter names mean the same thing in every loss and correction (`eps_low` is always the
lower clip width, `cap` always an upper truncation), so one table of rules (`PARAM_RULES`)
validates all of them. The accepted parameters of a function and their defaults are read from
its keyword-only signature: the code is the single source of truth.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Mapping

from qarl.algo.aggregation import AGGREGATIONS
from qarl.algo.common import Registry

# Keyword arguments of every loss that are supplied per call by the trainer, not by a recipe.
RUNTIME_KWARGS = ("is_weights", "num_tokens", "num_seqs")


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
