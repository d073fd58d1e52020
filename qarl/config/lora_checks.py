"""Checks of the `[lora]` section: what it can run with, the adapter it starts from, and its
targets against the model's layers (where the model's structure can be read without loading
weights: a prepared zoo model or a model folder; otherwise the same checks run when the
policy is built, before the first step)."""

from __future__ import annotations

from pathlib import Path

from qarl.config.errors import Problem
from qarl.model import ZOO, load_skeleton
from qarl.model.zoo import is_prepared, resolve


def lora_fits(lora, rollout, dist) -> list[Problem]:
    """LoRA runs on qarl's own engine (local, or Ray workers of it) with a whole or replicated
    learner: vLLM's layers take no per-step adapter push from qarl, and FSDP would shard
    frozen weights it never updates."""
    if not lora.rank:
        return []
    problems = []
    if rollout.engine != "local":
        problems.append(Problem("lora.rank", f"{lora.rank} with rollout.engine = "
                                f"{rollout.engine!r}: qarl pushes adapters into its own engine "
                                "only; use rollout.engine = 'local' (Ray rollout workers of it "
                                "are fine), or lora.rank = 0"))
    if dist.learner_ranks > 1 and dist.learner_strategy == "fsdp":
        problems.append(Problem("dist.learner_strategy", "'fsdp' with lora.rank > 0: the frozen "
                                "base has nothing to shard an update of; use 'replicate'"))
    return problems


def _skeleton(name: str):
    """The model's structure on the meta device, where it is readable without a conversion
    (a prepared zoo model, a model folder); None otherwise."""
    if name in ZOO and not Path(name).exists():
        if not is_prepared(name):
            return None
    elif not Path(name).is_dir():
        return None
    try:
        return load_skeleton(resolve(name))
    except Exception:  # noqa: BLE001 - model_loads reports what is wrong with the folder
        return None


def lora_resources(model, lora) -> list[Problem]:
    """lora.init_from is a PEFT LoRA folder of this rank and alpha; the targets match layers
    of the model, the rank fits them, the adapter's tensors fit them."""
    if not lora.rank:
        return []
    from qarl.lora.peft import config_problems, fit_problems
    from qarl.lora.layers import attach_lora, lora_targets

    problems = []
    if lora.init_from is not None:
        problems += [Problem("lora.init_from", text)
                     for text in config_problems(lora.init_from, lora.rank, lora.scale_alpha())]
    skeleton = _skeleton(model.name)
    if skeleton is None:
        return problems
    # the same call the trainer makes: its ValueError names the fix (no target, or a rank
    # wider than one), the key is the one at fault
    key = "lora.rank" if lora_targets(skeleton, lora.include, lora.exclude) else "lora.include"
    try:
        attach_lora(skeleton, lora.rank, lora.scale_alpha(), lora.dropout, lora.include,
                    lora.exclude, "zeros")
    except ValueError as err:
        return problems + [Problem(key, str(err))]
    if lora.init_from is not None and not problems:
        problems += [Problem("lora.init_from", text) for text in
                     fit_problems(lora.init_from, skeleton.config.family, skeleton)]
    return problems
