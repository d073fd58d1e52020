"""JSON that is JSON: every file qarl writes holds `null` where a figure is missing or not
finite (NaN, inf), never the bare `NaN` / `Infinity` Python's json module writes by default,
which jq, JavaScript and most JSON parsers reject. Readers take `null` as "no value"."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every float that is not finite replaced by None, in lists, tuples and
    dicts at any depth (tuples become lists, as JSON has them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """json.dumps of `finite(value)`; anything still not JSON raises (allow_nan=False)."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
