"""Checks that span fields, sections or other modules' registries.

Each check is a function of the validated sections it names and returns a list of Problems;
the loader runs a check only when all its sections validated, so one bad section never hides
the problems of another. The registries (qarl.quant.SCHEMES, qarl.algo.LOSSES / CORRECTIONS,
qarl.tasks.TASKS, the model zoo) are imported here lazily: loading a recipe imports them, but
importing qarl.config does not. A registry that a module does not define (yet) is not checked.
The docstring of each check is its rule as printed in docs/config.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from qarl.config.errors import Problem, short, suggest, unknown_key

DATASET_SUFFIXES = (".jsonl", ".parquet")


def registry(module: str, name: str) -> Any | None:
    """`module.name` if the module exists and defines it, else None (the check is skipped)."""
    if importlib.util.find_spec(module) is None:
        return None
    return getattr(importlib.import_module(module), name, None)


def _zoo_names() -> list[str] | None:
    zoo = registry("qarl.model.zoo", "ZOO")
    return None if zoo is None else sorted(zoo)


def signature_params(fn: Any) -> list[str] | None:
    """Keyword names `fn` (a function or class) accepts; None when it takes **kwargs or has no
    introspectable signature (then nothing is checked)."""
    if not (inspect.isfunction(fn) or inspect.isclass(fn)):
        return None
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def param_problems(
    path: str, params: Mapping[str, Any], valid: list[str] | None,
    validator: Any = None, name: str = "",
) -> list[Problem]:
    """Unknown names in `params` (each with the closest valid one); if there are none, what
    the owning module's `validator(name, params)` says about the values."""
    if valid is None:
        return []
    unknown = [unknown_key(path, key, valid, "parameter") for key in params if key not in valid]
    return unknown or _validate_with(path, validator, name, params)


def _names_of(module: str, lister: str, name: str) -> list[str] | None:
    """`module.lister(name)` (a dict of parameter names to defaults) as a list, if it exists."""
    function = registry(module, lister)
    return None if function is None else list(function(name))


def check_name(path: str, name: str, table: Any, what: str, extra: tuple = ()) -> list[Problem]:
    """`name` must be a key of `table` (or one of `extra`); None table = not checkable yet."""
    if table is None or name in table or name in extra:
        return []
    return [Problem(path, f"unknown {what} {name!r}; {suggest(name, [*table, *extra])}")]


def _validate_with(path: str, validator: Any, name: str, params: Mapping) -> list[Problem]:
    """Run a module's own `validate_*(name, params)`; what it raises becomes the problem."""
    if validator is None:
        return []
    try:
        validator(name, dict(params))
    except (ValueError, TypeError, KeyError) as error:
        return [Problem(path, str(error).strip("'\""))]
    return []


def run_name_is_a_folder(run) -> list[Problem]:
    """run.name is usable as a folder name."""
    if run.name is None or re.fullmatch(r"[A-Za-z0-9._-]+", run.name):
        return []
    return [Problem("run.name", f"{short(run.name)} is not a plain folder name; use letters, "
                                "digits, '.', '_' and '-' only")]


def batch_is_whole_groups(rollout) -> list[Problem]:
    """rollout.batch_size is a multiple of rollout.group_size (whole groups per step)."""
    if rollout.batch_size % rollout.group_size == 0:
        return []
    lower = rollout.batch_size // rollout.group_size * rollout.group_size
    suggestion = f"{lower} or {lower + rollout.group_size}" if lower else str(rollout.group_size)
    return [Problem(
        "rollout.batch_size",
        f"{rollout.batch_size} is not a multiple of rollout.group_size ({rollout.group_size}); "
        f"use e.g. {suggestion}",
    )]


def batch_is_whole_micro_batches(rollout, train) -> list[Problem]:
    """rollout.batch_size is a multiple of train.micro_batch_size."""
    if rollout.batch_size % train.micro_batch_size == 0:
        return []
    return [Problem(
        "train.micro_batch_size",
        f"rollout.batch_size ({rollout.batch_size}) is not a multiple of {train.micro_batch_size}; "
        "use a divisor of the batch size",
    )]


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
    tasks = registry("qarl.tasks", "TASKS")
    if task.dataset is None:
        problems = check_name("task.name", task.name, tasks, "task")
        if tasks is None or problems:
            return problems
        return param_problems("task.options", task.options, _names_of(
            "qarl.tasks", "task_options", task.name))
    problems = []
    if not Path(task.dataset).is_file():
        problems.append(Problem("task.dataset", f"file {task.dataset!r} does not exist"))
    if not task.dataset.endswith(DATASET_SUFFIXES):
        problems.append(Problem("task.dataset", f"{task.dataset!r} is neither .jsonl nor "
                                                ".parquet; convert it to one of them"))
    if tasks is not None and "dataset" in tasks:
        valid = [key for key in _names_of("qarl.tasks", "task_options", "dataset") or []
                 if key not in ("path", "reward")]
        problems += param_problems("task.options", task.options, valid)
    return problems


def reward_exists(task) -> list[Problem]:
    """task.reward is a built-in reward (qarl.tasks.REWARDS) or 'module:function'."""
    if task.reward is None or re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", task.reward):
        return []
    rewards = registry("qarl.tasks", "REWARDS")
    if rewards is not None and task.reward in rewards:
        return []
    if rewards and suggest(task.reward, rewards).startswith("did"):
        return [Problem("task.reward", f"{short(task.reward)} is not a built-in reward; "
                                       f"{suggest(task.reward, rewards)} (or give "
                                       "'module:function')")]
    builtin = f" ({', '.join(sorted(rewards))})" if rewards else ""
    return [Problem("task.reward", f"{short(task.reward)} is neither a built-in reward{builtin} "
                                   "nor 'module:function' (e.g. 'my_rewards:exact_match')")]


def scheme_exists(quant) -> list[Problem]:
    """quant.scheme is 'none' or a name in qarl.quant.SCHEMES; quant.options are options the
    scheme takes; 'none' takes no options."""
    if quant.scheme == "none":
        if quant.options:
            return [Problem("quant.options", "set while quant.scheme is 'none' (full "
                                             "precision); remove them or choose a scheme")]
        return []
    schemes = registry("qarl.quant", "SCHEMES")
    problems = check_name("quant.scheme", quant.scheme, schemes, "scheme", extra=("none",))
    if schemes is not None and not problems:
        # the quant package's own lister if it has one (like algo's loss_params), else the
        # scheme's signature when it is a function or class
        valid = _names_of("qarl.quant", "scheme_options", quant.scheme)
        if valid is None:
            valid = signature_params(schemes[quant.scheme])
        problems += param_problems("quant.options", quant.options, valid)
    return problems


def loss_exists(algo) -> list[Problem]:
    """algo.loss is in qarl.algo.LOSSES, algo.loss_params are parameters it accepts (checked by
    qarl.algo.validate_loss_params); algo.aggregation is in qarl.algo.AGGREGATIONS, the loss
    takes one, and it is not also set in loss_params."""
    losses = registry("qarl.algo", "LOSSES")
    problems = check_name("algo.loss", algo.loss, losses, "loss")
    if losses is None or problems:
        return problems
    valid = _names_of("qarl.algo", "loss_params", algo.loss)
    problems += param_problems("algo.loss_params", algo.loss_params, valid,
                               registry("qarl.algo", "validate_loss_params"), algo.loss)
    if algo.aggregation is None:
        return problems
    problems += check_name("algo.aggregation", algo.aggregation,
                           registry("qarl.algo", "AGGREGATIONS"), "aggregation")
    if valid is not None and "aggregation" not in valid:
        problems.append(Problem("algo.aggregation", f"loss {algo.loss!r} takes no aggregation; "
                                                    "remove it"))
    if "aggregation" in algo.loss_params:
        problems.append(Problem("algo.aggregation", "also set in algo.loss_params; keep one"))
    return problems


def correction_exists(algo) -> list[Problem]:
    """algo.correction (if set) is in qarl.algo.CORRECTIONS and algo.correction_params are
    parameters it accepts; correction_params need a correction."""
    if algo.correction is None:
        if not algo.correction_params:
            return []
        return [Problem("algo.correction_params", "set but algo.correction is not; name a "
                                                  "correction (e.g. 'tis_token') or remove them")]
    corrections = registry("qarl.algo", "CORRECTIONS")
    problems = check_name("algo.correction", algo.correction, corrections, "correction")
    if corrections is None or problems:
        return problems
    return param_problems("algo.correction_params", algo.correction_params,
                          _names_of("qarl.algo", "correction_params", algo.correction),
                          registry("qarl.algo", "validate_correction_params"), algo.correction)


def overlong_fits(algo, rollout) -> list[Problem]:
    """algo.overlong: l_cache < l_max <= rollout.max_new_tokens."""
    if algo.overlong is None:
        return []
    problems = []
    l_max, l_cache = algo.overlong.l_max, algo.overlong.l_cache
    if l_cache >= l_max:
        problems.append(Problem("algo.overlong.l_cache", f"{l_cache} must be below l_max "
                                f"({l_max}): the ramp starts at l_max - l_cache"))
    if l_max > rollout.max_new_tokens:
        problems.append(Problem("algo.overlong.l_max", f"{l_max} exceeds rollout.max_new_tokens "
                                f"({rollout.max_new_tokens}), so the penalty never completes; "
                                "use l_max <= max_new_tokens"))
    return problems


def schedule_fits(train) -> list[Problem]:
    """train.min_lr <= train.lr; train.warmup_steps <= train.steps; betas in [0, 1)."""
    problems = []
    if train.min_lr > train.lr:
        problems.append(Problem("train.min_lr", f"{train.min_lr} is above train.lr ({train.lr}); "
                                "the decay floor must be at most the peak"))
    if train.warmup_steps > train.steps:
        problems.append(Problem("train.warmup_steps", f"{train.warmup_steps} is more than "
                                f"train.steps ({train.steps}); use at most {train.steps}"))
    if not all(0 <= beta < 1 for beta in train.betas):
        problems.append(Problem("train.betas", f"each beta must be in [0, 1), got {train.betas}"))
    return problems


def context_fits(model, task, rollout, eval) -> list[Problem]:
    """With model.max_context set, task.max_prompt_tokens + rollout.max_new_tokens and
    task.max_prompt_tokens + eval.max_new_tokens fit in it."""
    if model.max_context is None:
        return []
    problems = []
    for path, new_tokens in (("rollout.max_new_tokens", rollout.max_new_tokens),
                             ("eval.max_new_tokens", eval.max_new_tokens)):
        if task.max_prompt_tokens + new_tokens > model.max_context:
            problems.append(Problem(path, f"{new_tokens} + task.max_prompt_tokens "
                                    f"({task.max_prompt_tokens}) exceeds model.max_context "
                                    f"({model.max_context}); shorten one or raise the context"))
    return problems


def model_exists(model) -> list[Problem]:
    """model.name is a zoo model or an existing local path."""
    if Path(model.name).exists():
        return []
    zoo = _zoo_names()
    looks_like_path = "/" in model.name or model.name.endswith((".gguf", ".safetensors"))
    if looks_like_path or (zoo is not None and model.name not in zoo):
        where = f"; zoo models: {', '.join(zoo)}" if zoo else ""
        return [Problem("model.name", f"{short(model.name)} is neither a zoo model nor an "
                                      f"existing path{where}")]
    return []


def tensorboard_available(log) -> list[Problem]:
    """log.tensorboard = true needs the tensorboard package ('auto' does not)."""
    if log.tensorboard is True and importlib.util.find_spec("tensorboard") is None:
        return [Problem("log.tensorboard", "true but the tensorboard package is not installed; "
                                           "install it or use 'auto'")]
    return []


# (sections it reads, check), in the order problems are reported
CHECKS: list[tuple[tuple[str, ...], Callable[..., list[Problem]]]] = [
    (("run",), run_name_is_a_folder),
    (("model",), model_exists),
    (("quant",), scheme_exists),
    (("rollout",), batch_is_whole_groups),
    (("rollout", "train"), batch_is_whole_micro_batches),
    (("task",), one_task_source),
    (("task",), reward_exists),
    (("algo",), loss_exists),
    (("algo",), correction_exists),
    (("algo", "rollout"), overlong_fits),
    (("train",), schedule_fits),
    (("model", "task", "rollout", "eval"), context_fits),
    (("log",), tensorboard_available),
]


def run_checks(sections: Mapping[str, Any]) -> list[Problem]:
    """All problems of the checks whose sections are all valid (present in `sections`)."""
    problems = []
    for needs, check in CHECKS:
        if all(name in sections for name in needs):
            problems += check(*(sections[name] for name in needs))
    return problems
