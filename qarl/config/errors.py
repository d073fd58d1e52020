"""ConfigError and the turning of pydantic errors into `path: what was wrong, what to do` lines."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any, NamedTuple

from pydantic import BaseModel

from qarl.errors import UserError


class Problem(NamedTuple):
    """One thing wrong with a recipe: the dotted field path and a message saying what to do."""

    path: str  # e.g. "rollout.batch_size"; "" for the recipe as a whole
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(UserError):
    """Every problem found in a recipe, raised once. `problems` holds them as `Problem`s."""

    def __init__(self, problems: Iterable[Problem], source: str = "recipe") -> None:
        self.problems = list(problems)
        self.source = source
        count = len(self.problems)
        head = f"{count} problem{'s' if count != 1 else ''} in {source}:"
        super().__init__("\n  - ".join([head, *map(str, self.problems)]))


def suggest(name: str, valid: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest valid name, or the sorted list when none is close."""
    valid = sorted(valid)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return "valid names: " + ", ".join(valid) if valid else "nothing is allowed here"


def unknown_key(path: str, key: str, valid: Iterable[str], what: str = "key") -> Problem:
    """The problem for a name that is not allowed at `path`, with the closest valid one."""
    full = f"{path}.{key}" if path else key
    return Problem(full, f"unknown {what} {key!r}; {suggest(key, valid)}")


def short(value: Any, limit: int = 60) -> str:
    """repr of a seen value, cut so one problem stays one line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_names(model: type[BaseModel] | None) -> list[str]:
    return sorted(model.model_fields) if model is not None else []


def _sub_model(model: type[BaseModel] | None, key: str) -> type[BaseModel] | None:
    """The pydantic model of field `key` of `model` (looking through `X | None`), if any."""
    if model is None or key not in model.model_fields:
        return None
    annotation = model.model_fields[key].annotation
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _real_path(loc: tuple, data: Any, model: type[BaseModel] | None) -> tuple[list, Any, Any]:
    """Split a pydantic loc into the keys present in the input and the owning model.

    pydantic adds tags for union members ('bool', "literal['auto']") to locs; they are not
    keys of the recipe, so they are dropped. Returns (path keys, owning model of the last key,
    the parent mapping).
    """
    keys: list = []
    parent_model, parent = model, data
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            parent_model, parent = model, node
            keys.append(part)
            node = node[part]
            model = _sub_model(model, part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            keys.append(part)
            node = node[part]
        elif not keys or isinstance(node, dict):
            # a missing field: part is a field name that is absent from the input
            if model is not None and part in model.model_fields:
                parent_model, parent = model, node
                keys.append(part)
                model = None
        # anything else is a union tag: skip it
    return keys, parent_model, parent


def _join(prefix: str, keys: list) -> str:
    text = prefix
    for key in keys:
        text = f"{text}[{key}]" if isinstance(key, int) else (f"{text}.{key}" if text else key)
    return text


def pydantic_problems(
    errors: list[dict], data: Any, model: type[BaseModel], prefix: str
) -> list[Problem]:
    """One Problem per offending field (union members' errors merged into one line)."""
    merged: dict[str, tuple[list[str], list[str]]] = {}  # path -> (messages, values seen)
    extra: list[Problem] = []
    for error in errors:
        keys, owner, _ = _real_path(tuple(error["loc"]), data, model)
        path = _join(prefix, keys)
        kind = error["type"]
        if kind == "extra_forbidden":
            extra.append(unknown_key(_join(prefix, keys[:-1]), keys[-1], _field_names(owner)))
            continue
        messages, seen = merged.setdefault(path, ([], []))
        if kind == "missing":
            messages.append("required but missing; set it in the recipe")
            continue
        message = error["msg"]
        if message.startswith("Input should be "):
            message = "should be " + message[len("Input should be "):]
        messages.append(message)
        seen.append(f"got {short(error['input'])}")
    problems = []
    for path, (messages, seen) in merged.items():
        # union members: "should be 'auto' or should be a valid boolean" -> "... or a valid ..."
        first, *rest = dict.fromkeys(messages)
        text = " or ".join([first, *(m.removeprefix("should be ") for m in rest)])
        problems.append(Problem(path, f"{text} ({seen[0]})" if seen else text))
    return extra + problems
