"""Checks that span fields, sections or other modules' registries.

Each check is a function of the validated sections it names and returns a list of Problems;
the loader runs a check only when all its sections validated, so one bad section never hides
the problems of another. Names are checked against the registries of the packages that own
them, imported here: `qarl.quant.SCHEMES`, `qarl.algo.LOSSES` / `CORRECTIONS` /
`AGGREGATIONS`, `qarl.tasks.TASKS` / `REWARDS` and `qarl.model.ZOO`, with each package's own
parameter lister and validator. The docstring of each check is its rule as printed in
docs/config.md.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from qarl.algo import (
    AGGREGATIONS,
    CORRECTIONS,
    LOSSES,
    correction_params,
    loss_params,
    validate_correction_params,
    validate_loss_params,
)
from qarl.config.errors import Problem, short, suggest
from qarl.config.names import check_name, param_problems
from qarl.config.compare_schema import flatten_overrides
from qarl.config.dist_checks import dist_is_possible
from qarl.config.lora_checks import lora_fits
from qarl.config.train_checks import (
    async_rollouts_fit,
    codes_backward_has_codes,
    device_exists,
    forward_logp_is_inexact_mode,
    masters_can_learn,
)
from qarl.config.resources import RESOURCE_CHECKS
from qarl.config.task_checks import (
    batched_reward_named,
    chat_template_reads,
    one_task_source,
    reward_exists,
)
from qarl.model import SUPPORTED_ARCHITECTURES, ZOO
from qarl.model.config import MOE_FAMILIES
from qarl.quant import SCHEMES, scheme_options
from qarl.rollout.engines import ENGINES

NAME_MAX = 200  # a run folder name: under the 255 bytes of file systems, with room for suffixes


def run_name_is_a_folder(run) -> list[Problem]:
    """run.name is usable as a folder name: letters, digits, '.', '_' and '-', at most
    NAME_MAX characters (file systems take 255 bytes; qarl adds suffixes such as
    `damaged_`)."""
    if run.name is None:
        return []
    if not re.fullmatch(r"[A-Za-z0-9._-]+", run.name):
        return [Problem("run.name", f"{short(run.name)} is not a plain folder name; use "
                                    "letters, digits, '.', '_' and '-' only")]
    if len(run.name) > NAME_MAX:
        return [Problem("run.name", f"is {len(run.name)} characters long, more than a folder "
                                    f"name may be ({NAME_MAX}); use a shorter one")]
    return []


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
    """rollout.batch_size is a multiple of train.micro_batch_size, and each of the
    train.mini_batches parts of it a whole number of micro-batches."""
    if rollout.batch_size % train.micro_batch_size:
        return [Problem(
            "train.micro_batch_size",
            f"rollout.batch_size ({rollout.batch_size}) is not a multiple of "
            f"{train.micro_batch_size}; use a divisor of the batch size",
        )]
    micro = rollout.batch_size // train.micro_batch_size
    if micro % train.mini_batches:
        fits = [d for d in range(1, micro + 1) if micro % d == 0]
        return [Problem(
            "train.mini_batches",
            f"{train.mini_batches} does not split the {micro} micro-batches of a step "
            f"(rollout.batch_size {rollout.batch_size} / train.micro_batch_size "
            f"{train.micro_batch_size}) into equal whole parts; use one of {fits}",
        )]
    return []


def scheme_exists(quant) -> list[Problem]:
    """quant.scheme is a name in qarl.quant.SCHEMES; quant.options are options the scheme
    takes; the full-precision scheme ('none') takes no options."""
    problems = check_name("quant.scheme", quant.scheme, SCHEMES, "scheme")
    if problems:
        return problems
    if SCHEMES[quant.scheme].is_identity:
        if quant.options:
            return [Problem("quant.options", f"set while quant.scheme is {quant.scheme!r} (full "
                                             "precision); remove them or choose a scheme")]
        return []
    return param_problems("quant.options", quant.options, list(scheme_options(quant.scheme)))


def loss_exists(algo) -> list[Problem]:
    """algo.loss is in qarl.algo.LOSSES, algo.loss_params are parameters it accepts (checked by
    qarl.algo.validate_loss_params); algo.aggregation (which every loss takes) is in
    qarl.algo.AGGREGATIONS and is not also set in loss_params."""
    problems = check_name("algo.loss", algo.loss, LOSSES, "loss")
    if not problems:  # a loss's parameters are known once the loss is
        problems += param_problems("algo.loss_params", algo.loss_params,
                                   list(loss_params(algo.loss)), validate_loss_params, algo.loss)
    if algo.aggregation is None:
        return problems
    problems += check_name("algo.aggregation", algo.aggregation, AGGREGATIONS, "aggregation")
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
    problems = check_name("algo.correction", algo.correction, CORRECTIONS, "correction")
    if problems:
        return problems
    return param_problems("algo.correction_params", algo.correction_params,
                          list(correction_params(algo.correction)),
                          validate_correction_params, algo.correction)


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
    if model.name in ZOO:
        return []
    return [Problem("model.name", f"{short(model.name)} is neither a zoo model nor an "
                                  f"existing path; zoo models: {', '.join(sorted(ZOO))}")]


def engine_fits(model, rollout, quant) -> list[Problem]:
    """rollout.engine's package is installed, and the engine serves quant.align (vLLM: 'fake'
    or 'naive': the learner cannot run its kernels), quant.scheme on this machine (vLLM: none
    and w8a8-int8 on its CPU build; also w8a8-fp8, w8a8-fp8-block, w4a16-int4, w4a16-nvfp4
    with CUDA) and the model (vLLM: dense models only: qarl cannot sync weights into its fused
    expert layers), in a dtype its kernels take here (qarl.rollout.ENGINES)."""
    kind = ENGINES[rollout.engine]
    problems = []
    if not kind.installed():
        problems.append(Problem("rollout.engine", f"{kind.name!r} but the {kind.package} package "
                                                  f"is not installed; {kind.install}, or use 'local'"))
    if quant.align not in kind.aligns:
        problems.append(Problem("quant.align", f"{quant.align!r} with rollout.engine = "
                                f"{kind.name!r}: the learner cannot run that engine's kernels; "
                                f"use {' or '.join(map(repr, sorted(kind.aligns)))}"))
    served = kind.schemes()
    if quant.scheme in SCHEMES and quant.scheme not in served:
        problems.append(Problem("quant.scheme", f"{quant.scheme!r} is not served by "
                                f"rollout.engine = {kind.name!r} on this machine (it serves "
                                f"{', '.join(served)}); use one of those, or rollout.engine = "
                                "'local'"))
    if kind.dense_only and model_family(model.name) in MOE_FAMILIES:
        problems.append(Problem("rollout.engine", f"{kind.name!r} with the mixture-of-experts "
                                f"model {short(model.name)}: qarl cannot sync weights into its "
                                "fused expert layers; use rollout.engine = 'local'"))
    return problems + [Problem(path, message) for path, message in kind.problems(rollout, quant)]


def sync_delta_fits(quant, rollout, lora) -> list[Problem]:
    """quant.sync_delta = true needs pushes of codes to an engine that takes deltas: a
    quantized scheme, fake or kernel alignment, an engine kind that takes them (the local
    engine), and no LoRA adapters (whose pushes are the adapters alone)."""
    if quant.sync_delta is not True:
        return []
    why = []
    if quant.scheme in SCHEMES and SCHEMES[quant.scheme].is_identity:
        why.append(f"quant.scheme = {quant.scheme!r} has no codes")
    if quant.align == "naive":
        why.append("quant.align = 'naive' pushes full-precision weights")
    if not ENGINES[rollout.engine].deltas:
        why.append(f"rollout.engine = {rollout.engine!r} takes whole states only")
    if lora.rank:
        why.append("a LoRA run pushes its adapters alone")
    if not why:
        return []
    return [Problem("quant.sync_delta", f"true, but {'; '.join(why)}; set it to 'auto' or "
                    "false")]


def truncation_is_recorded(rollout) -> list[Problem]:
    """Truncated sampling (top_p < 1, top_k > 0 or min_p > 0) with the correction on needs the
    sampler's kept sets, which only qarl's own engine records."""
    truncates = rollout.top_p < 1.0 or rollout.top_k > 0 or rollout.min_p > 0.0
    if not truncates or not rollout.truncation_correction or rollout.engine == "local":
        return []
    return [Problem("rollout.truncation_correction", f"true with truncated sampling on "
                    f"rollout.engine = {rollout.engine!r}, which does not report the tokens it "
                    "kept; use rollout.engine = 'local', sample without truncation (top_p = 1, "
                    "top_k = 0, min_p = 0), or set rollout.truncation_correction = false to "
                    "train on the biased ratio")]


def fsdp_is_dense(model, dist) -> list[Problem]:
    """dist.learner_strategy = 'fsdp' takes dense models: an expert no token of a rank's
    micro-batches reaches has no gradient there, and FSDP's reduce-scatter needs every rank to
    send every gradient (zeros would make AdamW step experts a one-rank run leaves alone)."""
    if dist.learner_strategy != "fsdp" or model_family(model.name) not in MOE_FAMILIES:
        return []
    return [Problem("dist.learner_strategy", f"'fsdp' with the mixture-of-experts model "
                    f"{short(model.name)}: experts unused on one rank have no gradient to "
                    "reduce-scatter; use learner_strategy = 'replicate'")]


def routing_replay_needs_moe(model, quant) -> list[Problem]:
    """quant.routing_replay = true needs a mixture-of-experts model (qwen3_moe or mixtral)."""
    if not quant.routing_replay:
        return []
    family = model_family(model.name)
    if family is None or family in MOE_FAMILIES:  # unknown here (no such path, a .gguf): loading decides
        return []
    return [Problem("quant.routing_replay", f"true, but model {short(model.name)} is a dense "
                                            f"{family} model with no experts to replay; set it "
                                            f"to false or pick a MoE model (e.g. tiny-moe)")]


def model_family(name: str) -> str | None:
    """The family of a zoo model or of a model folder's config.json; None when unknown."""
    if name in ZOO and not Path(name).exists():
        return ZOO[name].family
    try:
        architectures = json.loads((Path(name) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError):  # no folder, no config.json, not JSON: loading will say
        return None
    architectures = architectures or [None]
    return SUPPORTED_ARCHITECTURES.get(architectures[0])


def tensorboard_available(log) -> list[Problem]:
    """log.tensorboard = true needs the tensorboard package ('auto' does not)."""
    if log.tensorboard is True and importlib.util.find_spec("tensorboard") is None:
        return [Problem("log.tensorboard", "true but the tensorboard package is not installed; "
                                           "install it or use 'auto'")]
    return []


def wandb_available(log) -> list[Problem]:
    """log.wandb = true needs the wandb package."""
    if log.wandb and importlib.util.find_spec("wandb") is None:
        return [Problem("log.wandb", "true but the wandb package is not installed; "
                                     "pip install 'qarl[wandb]', or set log.wandb = false")]
    return []


def compare_arms_consistent(compare) -> list[Problem]:
    """[compare]: arm names are plain folder names; reference, baseline and every optional
    name an arm; seeds and held-out seeds are distinct, not negative and in one list only;
    neither an arm nor compare.overrides sets a run.* key (compare sets each run's seed and
    folder) or a compare.* key."""
    problems = [Problem(f"compare.arms.{arm}", "is not a plain folder name; use letters, "
                                               "digits, '.', '_' and '-' only")
                for arm in compare.arms if not re.fullmatch(r"[A-Za-z0-9._-]+", arm)]
    named = [("compare.reference", compare.reference), ("compare.baseline", compare.baseline)]
    named += [(f"compare.optional[{i}]", arm) for i, arm in enumerate(compare.optional)]
    problems += [Problem(path, f"{arm!r} is not an arm; {suggest(arm, compare.arms)}")
                 for path, arm in named if arm is not None and arm not in compare.arms]
    for path, seeds in (("compare.seeds", compare.seeds),
                        ("compare.held_out_seeds", compare.held_out_seeds)):
        repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
        if repeated:
            problems.append(Problem(path, f"repeats {repeated}; list each seed once"))
        if any(seed < 0 for seed in seeds):
            problems.append(Problem(path, f"{seeds} holds a negative seed; seeds are run.seed "
                                          "values, 0 or more"))
    shared = sorted(set(compare.seeds) & set(compare.held_out_seeds))
    if shared:
        problems.append(Problem("compare.held_out_seeds", f"{shared} also in compare.seeds; a "
                                "held-out seed is kept out of the development seeds: list it "
                                "in one of the two"))
    tables = {"compare.overrides": compare.overrides,
              **{f"compare.arms.{arm}": table for arm, table in compare.arms.items()}}
    for path, table in tables.items():
        problems += [Problem(path, f"sets {key!r}; compare sets run.seed, run.output_dir and "
                                   "run.name of each run, and arms cannot hold [compare] keys; "
                                   "remove it (or set it in the recipe, for every arm)")
                     for key in flatten_overrides(table) if key.split(".")[0] in ("run", "compare")]
    return problems


# (sections it reads, check), in the order problems are reported
CHECKS: list[tuple[tuple[str, ...], Callable[..., list[Problem]]]] = [
    (("run",), run_name_is_a_folder),
    (("model",), model_exists),
    (("quant",), scheme_exists),
    (("model", "quant"), routing_replay_needs_moe),
    (("rollout",), batch_is_whole_groups),
    (("rollout", "train"), batch_is_whole_micro_batches),
    (("task",), one_task_source),
    (("task",), reward_exists),
    (("task",), chat_template_reads),
    (("task",), batched_reward_named),
    (("algo",), loss_exists),
    (("algo",), correction_exists),
    (("algo", "rollout"), overlong_fits),
    (("train",), schedule_fits),
    (("model", "train", "sft"), masters_can_learn),
    (("train", "quant"), forward_logp_is_inexact_mode),
    (("train", "quant"), codes_backward_has_codes),
    (("train", "dist"), device_exists),
    (("model", "task", "rollout", "eval"), context_fits),
    (("model", "rollout", "quant"), engine_fits),
    (("rollout",), truncation_is_recorded),
    (("quant", "rollout", "lora"), sync_delta_fits),
    (("log",), tensorboard_available),
    (("log",), wandb_available),
    (("dist", "rollout", "train"), dist_is_possible),
    (("train", "rollout", "dist"), async_rollouts_fit),
    (("model", "dist"), fsdp_is_dense),
    (("lora", "rollout", "dist"), lora_fits),
    (("compare",), compare_arms_consistent),
]


def run_checks(sections: Mapping[str, Any]) -> list[Problem]:
    """All problems of the checks whose sections are all valid (present in `sections`): the
    checks above, then those of what the recipe points at (`resources.RESOURCE_CHECKS`)."""
    problems = []
    for needs, check in CHECKS + RESOURCE_CHECKS:
        if needs == ("*",):
            problems += check(sections)
        elif all(name in sections for name in needs):
            problems += check(*(sections[name] for name in needs))
    return problems
