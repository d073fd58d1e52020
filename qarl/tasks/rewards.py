"""Reward functions and how a recipe names them.

A reward is `(prompt: str, completion: str, **fields) -> float | None`; None means "cannot be
scored" (the trainer leaves it out of the group baseline). A recipe names a reward either by a
built-in name (`REWARDS`) or as `"package.module:function"`; `load_reward` resolves both, in the
trainer or inside a reward worker process.
"""

from __future__ import annotations

import importlib
import inspect
import traceback
from typing import Any

from qarl.tasks.base import RewardFn

REWARDS = {
    "addition": "qarl.tasks.addition:addition_reward",
    "column_addition": "qarl.tasks.column_addition:column_addition_reward",
    "math_answer": "qarl.tasks.math_reward:math_answer_reward",
}


def resolve_spec(name_or_spec: str) -> str:
    """The "module:function" spec of a built-in reward name, or the spec itself."""
    if not isinstance(name_or_spec, str) or not name_or_spec.strip():
        raise ValueError(
            f"a reward is named by a string, got {name_or_spec!r}; use a built-in name "
            f"({', '.join(sorted(REWARDS))}) or 'package.module:function'"
        )
    if ":" in name_or_spec:
        return name_or_spec.strip()
    if name_or_spec in REWARDS:
        return REWARDS[name_or_spec]
    raise ValueError(
        f"unknown reward {name_or_spec!r}; valid built-in rewards: {sorted(REWARDS)}, "
        "or give your own as 'package.module:function'"
    )


def load_reward(name_or_spec: str) -> RewardFn:
    """The reward function named by a built-in name or a "module:function" spec.

    "module:function" imports `module` (from sys.path, so the current folder works for local
    files) and looks up `function`, which may be dotted ("mod:Class.method").
    """
    spec = resolve_spec(name_or_spec)
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(
            f"reward spec {spec!r} must look like 'package.module:function' "
            "(module and function both non-empty)"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name + ".").startswith(e.name + "."):
            raise ValueError(
                f"reward module {module_name!r} (from {spec!r}) was not found; check the name "
                "and that its folder is on sys.path / PYTHONPATH or the package is installed"
            ) from e
        raise ImportError(f"importing reward module {module_name!r} failed: "
                          f"{last_frame(e)}") from e
    except Exception as e:  # the module's own code raised while it was imported
        raise ImportError(f"importing reward module {module_name!r} raised "
                          f"{last_frame(e)}") from e
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            public = sorted(n for n in dir(target) if not n.startswith("_"))
            raise ValueError(
                f"reward {spec!r}: {getattr(target, '__name__', module_name)!r} has no attribute "
                f"{part!r}; public names there: {public[:20]}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(
            f"reward {spec!r} is a {type(target).__name__}, not a function; point the spec at a "
            "callable (prompt, completion, **fields) -> float | None"
        )
    return target


def last_frame(exc: BaseException) -> str:
    """'Type: message (at file:line in function)' of an exception: where in a user's code it
    was raised, without the rest of the traceback."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {last.filename}:{last.lineno} in {last.name})"
    return text


def check_signature(fn: RewardFn, spec: str, fields: dict[str, Any],
                    batched: bool = False) -> None:
    """Raise TypeError unless `fn` takes a call (prompt, completion, **fields) with these
    fields, as the reward runner makes it (batched: lists of them); the message names the
    fields and the fix."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function without a signature: its first call will tell
    try:
        if batched:
            signature.bind(["prompt"], ["completion"], **{k: [v] for k, v in fields.items()})
        else:
            signature.bind("prompt", "completion", **fields)
    except TypeError as err:
        shape = ("(prompts, completions, **fields) -> list[float | None], each field a list"
                 if batched else "(prompt, completion, **fields) -> float | None")
        raise TypeError(
            f"reward {spec!r}{signature} cannot take a call {shape.split(' ->')[0]} with this "
            f"task's fields {sorted(fields)}: {err}; define it as def fn{shape}") from None
