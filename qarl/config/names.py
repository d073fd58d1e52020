"""Problems with names and parameters: a name that is not a key of its registry, and
parameters a registered function does not take or whose values its own validator refuses."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from qarl.config.errors import Problem, suggest, unknown_key


def param_problems(
    path: str, params: Mapping[str, Any], valid: list[str],
    validator: Callable[[str, dict], Any] | None = None, name: str = "",
) -> list[Problem]:
    """Unknown names in `params` (each with the closest valid one); if there are none, what
    the owning module's `validator(name, params)` says about the values."""
    unknown = [unknown_key(path, key, valid, "parameter") for key in params if key not in valid]
    return unknown or _validate_with(path, validator, name, params)


def check_name(path: str, name: str, table: Any, what: str) -> list[Problem]:
    """`name` must be a key of `table`."""
    if name in table:
        return []
    return [Problem(path, f"unknown {what} {name!r}; {suggest(name, list(table))}")]


def _validate_with(path: str, validator: Any, name: str, params: Mapping) -> list[Problem]:
    """Run a module's own `validate_*(name, params)`; what it raises becomes the problem."""
    if validator is None:
        return []
    try:
        validator(name, dict(params))
    except (ValueError, TypeError, KeyError) as error:
        return [Problem(path, str(error).strip("'\""))]
    return []
