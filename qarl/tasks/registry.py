"""The task registry: `TASKS[name]` and `make_task(name, **options)`."""

from __future__ import annotations

import inspect
from typing import Any

from qarl.tasks.addition import AdditionTask
from qarl.tasks.base import Task
from qarl.tasks.column_addition import ColumnAdditionTask
from qarl.tasks.dataset_task import DatasetTask

TASKS = {
    "addition": AdditionTask,
    "column_addition": ColumnAdditionTask,
    "dataset": DatasetTask,
}


def task_options(name: str) -> dict[str, Any]:
    """Option names of a task and their defaults (inspect.Parameter.empty when required)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    params = inspect.signature(TASKS[name]).parameters
    return {p.name: p.default for p in params.values()}


def make_task(name: str, **options: Any) -> Task:
    """The task `name` built with `options`; unknown or missing options raise, all at once."""
    valid = task_options(name)
    problems = [
        f"unknown option {key!r} (valid options: {sorted(valid)})"
        for key in sorted(options)
        if key not in valid
    ]
    problems += [
        f"missing required option {key!r}"
        for key, default in valid.items()
        if default is inspect.Parameter.empty and key not in options
    ]
    if problems:
        raise ValueError(f"invalid options for task {name!r}: " + "; ".join(problems))
    return TASKS[name](**options)
