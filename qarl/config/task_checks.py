"""Checks of the recipe's `[task]`: where its prompts come from and how they are rewarded."""

from __future__ import annotations

import re
from pathlib import Path

from qarl.config.errors import Problem, short, suggest
from qarl.config.names import check_name, param_problems
from qarl.model.tokenizer import read_chat_template
from qarl.tasks import REWARDS, TASKS, open_options, task_options

DATASET_SUFFIXES = (".jsonl", ".parquet")


def one_task_source(task) -> list[Problem]:
    """Exactly one of task.name and task.dataset is set; a dataset is an existing .jsonl or
    .parquet file; a task name exists in qarl.tasks.TASKS; task.options are options of the
    task (for a dataset: of the 'dataset' task, less path and reward which have their own keys)."""
    if task.name is None and task.dataset is None:
        return [Problem("task", "set task.name (a built-in task, e.g. 'addition') or "
                                "task.dataset (a .jsonl or .parquet file)")]
    if task.name is not None and task.dataset is not None:
        return [Problem("task", f"both name ({task.name!r}) and dataset ({task.dataset!r}) are "
                                "set; keep one (on the command line unset the other with "
                                "--task.name= or --task.dataset=)")]
    if task.dataset is None:
        problems = check_name("task.name", task.name, TASKS, "task")
        if problems:
            return problems
        if open_options(task.name):  # e.g. a reasoning-gym generator's own parameters
            return [Problem("task.options" + (f".{path}" if path else ""), message)
                    for path, message in TASKS[task.name].option_problems(task.options)]
        return param_problems("task.options", task.options, list(task_options(task.name)))
    problems = []
    if not Path(task.dataset).is_file():
        problems.append(Problem("task.dataset", f"file {task.dataset!r} does not exist"))
    if not task.dataset.endswith(DATASET_SUFFIXES):
        problems.append(Problem("task.dataset", f"{task.dataset!r} is neither .jsonl nor "
                                                ".parquet; convert it to one of them"))
    valid = [key for key in task_options("dataset") if key not in ("path", "reward")]
    options = param_problems("task.options", task.options, valid)
    if options and not any(key in valid for key in task.options):
        # options of another task (a recipe's built-in task, now replaced by a dataset)
        return problems + [Problem("task.options", f"{sorted(task.options)} are not options "
                                   f"of a dataset task (valid: {', '.join(valid)}); a recipe "
                                   "written for a built-in task keeps them: unset them with "
                                   "--task.options={}")]
    return problems + options


def reward_exists(task) -> list[Problem]:
    """task.reward is a built-in reward (qarl.tasks.REWARDS) or 'module:function'."""
    if task.reward is None or re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", task.reward):
        return []
    if task.reward in REWARDS:
        return []
    if suggest(task.reward, REWARDS).startswith("did"):
        return [Problem("task.reward", f"{short(task.reward)} is not a built-in reward; "
                                       f"{suggest(task.reward, REWARDS)} (or give "
                                       "'module:function')")]
    return [Problem("task.reward", f"{short(task.reward)} is neither a built-in reward "
                                   f"({', '.join(sorted(REWARDS))}) nor 'module:function' "
                                   "(e.g. 'my_rewards:exact_match')")]


def chat_template_reads(task) -> list[Problem]:
    """A task.chat_template string is Jinja text that compiles, or names a file holding such."""
    if not isinstance(task.chat_template, str):
        return []
    try:
        read_chat_template(task.chat_template)
    except ValueError as err:
        return [Problem("task.chat_template", f"{err}; or true (the tokenizer's own template) "
                                              "or false (plain text)")]
    return []


def batched_reward_named(task) -> list[Problem]:
    """task.reward_batch = true needs a 'module:function' reward: the built-in rewards and
    the tasks' own verifiers take one completion per call."""
    if not task.reward_batch or (task.reward is not None and ":" in task.reward):
        return []
    seen = "the task's own verifier" if task.reward is None else f"built-in {task.reward!r}"
    return [Problem("task.reward_batch", f"true with {seen}, which takes one completion per "
                    "call; give task.reward = 'module:function' taking (prompts, completions, "
                    "**fields) lists, or set task.reward_batch = false")]
