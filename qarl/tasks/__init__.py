"""Built-in verifiable tasks, dataset files, reward functions and the reward runner.

Imports no torch: reward worker processes import this package and must start fast.
`math_answer_reward` is loaded on first use (math-verify pulls in sympy, about a second).
"""

from qarl.tasks.addition import AdditionTask, addition_reward, extract_answer
from qarl.tasks.base import SPLITS, Example, Task, split_of
from qarl.tasks.column_addition import ColumnAdditionTask, column_addition_reward, grammar_ok
from qarl.tasks.dataset_task import DatasetTask
from qarl.tasks.datasets import BAD_ROW_REASONS, DatasetReport, load_dataset
from qarl.tasks.reasoning_gym_task import ReasoningGymTask
from qarl.tasks.registry import TASKS, make_task, open_options, task_options
from qarl.tasks.rewards import REWARDS, load_reward, resolve_spec
from qarl.tasks.runner import OUTCOMES, RewardResult, RewardRunner

__all__ = [
    "BAD_ROW_REASONS",
    "OUTCOMES",
    "REWARDS",
    "SPLITS",
    "TASKS",
    "AdditionTask",
    "ColumnAdditionTask",
    "DatasetReport",
    "DatasetTask",
    "Example",
    "RewardResult",
    "RewardRunner",
    "ReasoningGymTask",
    "Task",
    "addition_reward",
    "column_addition_reward",
    "extract_answer",
    "grammar_ok",
    "load_dataset",
    "load_reward",
    "make_task",
    "math_answer_reward",
    "open_options",
    "resolve_spec",
    "split_of",
    "task_options",
]


def __getattr__(name: str):
    if name == "math_answer_reward":
        from qarl.tasks.math_reward import math_answer_reward

        return math_answer_reward
    raise AttributeError(f"module 'qarl.tasks' has no attribute {name!r}")
