"""A recipe's `[lora]` section applied to a model: adapters attached to the learner (and
started from a PEFT folder) or to an engine's copy. `lora` below is that section
(`qarl.config.LoraSection`: rank, alpha, dropout, include, exclude, init, init_from)."""

from __future__ import annotations

from torch import nn

from qarl.errors import UserError
from qarl.lora.layers import attach_lora, lora_names
from qarl.lora.peft import import_peft


def attach_adapters(model: nn.Module, lora, init: str | None = None) -> list[str]:
    """`attach_lora` with the recipe's [lora] (its init unless `init` says otherwise); a target
    or rank that does not fit the model is a UserError naming the key."""
    try:
        return attach_lora(model, lora.rank, lora.scale_alpha(), lora.dropout, lora.include,
                           lora.exclude, init or lora.init)
    except ValueError as err:
        raise UserError(f"[lora] {err}") from None


def adapt_learner(learner: nn.Module, lora) -> list[str]:
    """The learner's adapters (`lora.rank` > 0: attached, frozen base, started from
    `lora.init_from` when given); returns the adapters' tensor names (none for full weights)."""
    if not lora.rank:
        return []
    attach_adapters(learner, lora)
    if lora.init_from is not None:
        import_peft(learner, lora.init_from, learner.config.family)
    return lora_names(learner)
