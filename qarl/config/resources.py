"""Checks of what a recipe points at and of values only their owners can judge: the model
folder (config, tokenizer, weight headers), the dataset file and its splits, the reward
function, the scheme's and the task's option values, the run folder, and non-finite numbers.

They read (headers, the dataset) and import a recipe's own reward module (to show an error it
raises as such, and to bind its signature to the task's fields), but never write, and run
with the other checks when the recipe loads, so every problem is reported at once, before any work and
before the run folder is touched. Each guards itself: a name the name checks already refuse
is not checked again here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from qarl.config.errors import Problem
from qarl.config.lora_checks import lora_resources
from qarl.model.check import source_problems
from qarl.quant import SCHEMES, make_scheme, scheme_options
from qarl.tasks import TASKS, make_task, open_options, task_options
from qarl.tasks.rewards import check_signature, load_reward


def finite_numbers(sections: Mapping[str, Any]) -> list[Problem]:
    """Every number in the recipe is finite (inf passes range checks: lr = inf would poison the
    weights; nan fails them)."""
    problems = []

    def walk(path: str, value: Any) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(Problem(path, f"is {value}; a recipe number must be finite"))
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{path}.{key}", item)
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(f"{path}[{i}]", item)

    for name, section in sections.items():
        walk(name, section.model_dump() if section is not None else None)
    return problems


def model_loads(model) -> list[Problem]:
    """A model path holds a loadable model: config.json of a supported family, tokenizer
    files, whole safetensors weights (headers checked, no data read); or a readable .gguf.
    A zoo model already prepared is checked the same way."""
    return [Problem("model.name", text) for text in source_problems(model.name)]


def scheme_options_valid(quant) -> list[Problem]:
    """quant.options hold values the scheme accepts (e.g. group_size in its list)."""
    if (quant.scheme not in SCHEMES or SCHEMES[quant.scheme].is_identity
            or set(quant.options) - set(scheme_options(quant.scheme))):
        return []  # scheme_exists names the unknown scheme or options
    try:
        make_scheme(quant.scheme, **quant.options)
    except (ValueError, TypeError) as err:
        return [Problem("quant.options", str(err))]
    return []


def options_known(named: str | None, options: dict) -> bool:
    """Whether the task exists and takes these options (else one_task_source says why)."""
    if named not in TASKS:
        return False
    if open_options(named):
        return not TASKS[named].option_problems(options)
    return not set(options) - set(task_options(named))


def task_loads(task, eval) -> list[Problem]:
    """The task builds with its options (values in range); a dataset file has usable rows in
    its train split and, when eval.size > 0, in its eval split."""
    named = "dataset" if task.dataset is not None else task.name
    if not options_known(named, task.options):
        return []  # one_task_source names the unknown task or options
    if task.dataset is not None:
        if not Path(task.dataset).is_file():
            return []  # one_task_source says so
        build: Callable[[], Any] = lambda: make_task("dataset", path=task.dataset, **task.options)
        where = "task.dataset"
    else:
        build, where = lambda: make_task(task.name, **task.options), "task.options"
    try:
        built = build()
    except (ValueError, TypeError, OSError) as err:
        return [Problem(where, str(err))]
    split_size = getattr(built, "split_size", None)
    if split_size is None:
        return []
    problems = []
    for split, needed in (("train", True), ("eval", eval.size and eval.size > 0)):
        if needed and split_size(split) == 0:
            problems.append(Problem(where, f"the {split} split of {task.dataset} is empty "
                                           f"({built.report.summary()}); give "
                                           "task.options.eval_path, or an eval_fraction that "
                                           "leaves rows in both splits"))
    return problems


def reward_loads(task) -> list[Problem]:
    """A 'module:function' reward imports (an error while its module runs is shown as such,
    with where it was raised), names a function, and takes a call (prompt, completion,
    **fields) with the fields of the task's first training row (with task.reward_batch: lists
    of them), as the reward workers will make it; all before any model loads."""
    if task.reward is None or ":" not in task.reward:
        return []  # a built-in reward; reward_exists names an unknown one
    try:
        fn = load_reward(task.reward)
    except (ImportError, ValueError, TypeError) as err:
        return [Problem("task.reward", str(err))]
    example = _first_example(task)
    if example is None:
        return []  # the task does not build: task_loads / one_task_source say why
    try:
        check_signature(fn, task.reward, example.reward_kwargs(), batched=task.reward_batch)
    except TypeError as err:
        return [Problem("task.reward", str(err))]
    return []


def sft_has_completions(task, sft) -> list[Problem]:
    """With sft.steps > 0, every training row of a task.dataset has a `completion` (non-empty
    text): the warm start trains on it as the response the reward scores 1.0, which the
    `answer` alone is not (the reward may want the answer in a form, after working)."""
    if not sft.steps or task.dataset is None:
        return []
    rows = _train_examples(task, None)
    if rows is None:
        return []  # the dataset does not build: task_loads / one_task_source say why
    lacking = sorted(ex.row or 0 for ex in rows
                     if not (isinstance(c := ex.fields.get("completion"), str) and c.strip()))
    if not lacking:
        return []
    shown = ", ".join(map(str, lacking[:5])) + (", ..." if len(lacking) > 5 else "")
    return [Problem("task.dataset", f"{len(lacking)} of the {len(rows)} training rows of "
                                    f"{task.dataset} have no 'completion' text (rows {shown}), "
                                    f"which the warm start (sft.steps = {sft.steps}) trains on; "
                                    "add a 'completion' column (a whole response the reward "
                                    "scores 1.0), or set sft.steps = 0")]


def _first_example(task) -> Any:
    """The task's first training example, or None where the task does not build."""
    examples = _train_examples(task, 1)
    return examples[0] if examples else None


def _train_examples(task, n: int | None) -> list | None:
    """`n` training examples of the task (None: every row of its train split, each once),
    or None where the task does not build."""
    named = "dataset" if task.dataset is not None else task.name
    if not options_known(named, task.options):
        return None
    if task.dataset is not None and not Path(task.dataset).is_file():
        return None
    try:
        built = (make_task("dataset", path=task.dataset, **task.options)
                 if task.dataset is not None else make_task(task.name, **task.options))
        if n is None:
            n = built.split_size("train")
        return built.examples("train", n, 0)
    except (ValueError, TypeError, OSError):
        return None


def run_folder_writable(run) -> list[Problem]:
    """The run folder (run.output_dir / run.name) is a folder qarl can create or write: no
    file in its way, on a disk that takes writes."""
    if run.name is None:
        return []
    return _folder_problems(Path(run.output_dir) / run.name, "run.output_dir", "the run folder")


def eval_cache_writable(eval) -> list[Problem]:
    """eval.cache_dir, when set, is a folder qarl can create or write, as the run folder is
    (it is written after the first evaluation, when the run has begun)."""
    if not eval.cache_dir:
        return []
    return _folder_problems(Path(eval.cache_dir), "eval.cache_dir", "the evaluation cache")


def _folder_problems(folder: Path, key: str, what: str) -> list[Problem]:
    """`folder` can be made (no file where it or a parent goes) and written."""
    for path in (folder, *folder.parents):
        if path.exists():
            break
    if not path.is_dir():
        return [Problem(key, f"{path} is a file, so {what} {folder} cannot be created there; "
                             f"choose another {key}")]
    if not os.access(path, os.W_OK | os.X_OK):
        return [Problem(key, f"{path} cannot be written (a read-only disk, or no permission), "
                             f"so {what} {folder} cannot be made or updated; choose another "
                             f"{key}")]
    return []


# (sections it reads, check), run after checks.CHECKS; "*" = every section
RESOURCE_CHECKS: list[tuple[tuple[str, ...], Callable[..., list[Problem]]]] = [
    (("*",), finite_numbers),
    (("run",), run_folder_writable),
    (("eval",), eval_cache_writable),
    (("model",), model_loads),
    (("quant",), scheme_options_valid),
    (("task", "eval"), task_loads),
    (("task",), reward_loads),
    (("task", "sft"), sft_has_completions),
    (("model", "lora"), lora_resources),
]
