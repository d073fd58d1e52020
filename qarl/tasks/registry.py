"""The task registry: `TASKS[name]` and `make_task(name, **options)`."""

from __future__ import annotations

import inspect
from typing import Any

from qarl.tasks.addition import AdditionTask
from qarl.tasks.base import Task
from qarl.tasks.column_addition import ColumnAdditionTask
from qarl.tasks.dataset_task import DatasetTask
from qarl.tasks.reasoning_gym_task import ReasoningGymTask

TASKS = {
    "addition": AdditionTask,
    "column_addition": ColumnAdditionTask,
    "dataset": DatasetTask,
    "reasoning_gym": ReasoningGymTask,
}


def task_options(name: str) -> dict[str, Any]:
    """Option names of a task and their defaults (inspect.Parameter.empty when required); a
    task that also takes options of its own choosing (`**params`, e.g. a reasoning-gym
    generator's parameters) checks them itself with `option_problems`."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    params = inspect.signature(TASKS[name]).parameters
    return {p.name: p.default for p in params.values() if p.kind is not p.VAR_KEYWORD}


def open_options(name: str) -> bool:
    """Whether task `name` takes options beyond its named ones (and checks them itself)."""
    params = inspect.signature(TASKS[name]).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in params)


def make_task(name: str, **options: Any) -> Task:
    """The task `name` built with `options`; unknown or missing options raise, all at once."""
    valid = task_options(name)
    problems = [
        f"unknown option {key!r} (valid options: {sorted(valid)})"
        for key in sorted(options)
        if key not in valid and not open_options(name)
    ]
    problems += [
        f"missing required option {key!r}"
        for key, default in valid.items()
        if default is inspect.Parameter.empty and key not in options
    ]
    if problems:
        raise ValueError(f"invalid options for task {name!r}: " + "; ".join(problems))
    return TASKS[name](**options)
