"""Whether a checkpoint's weights fit a model, read from the file's header alone.

`qarl eval --checkpoint`, `qarl export` and a resume ask it before any tensor loads, so a
checkpoint of another model or [lora] is one clear refusal instead of a failure halfway.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from qarl.lora.layers import LORA_PARAMS, adapter_state
from qarl.model.loading import safetensors_shapes


def weights_problem(folder: Path, model: nn.Module) -> str | None:
    """Why the weights of checkpoint `folder` cannot go into `model` (a meta-device skeleton
    will do): names missing or unexpected, shapes that differ; read from the file's header,
    no tensor. None when they fit; a UserError where the file is not whole. A LoRA model
    takes exactly its adapters; a full one every parameter (a tied lm_head is stored as the
    embedding)."""
    file = Path(folder) / "model.safetensors"
    theirs = safetensors_shapes(file)
    adapters = adapter_state(model)
    own = {n: tuple(t.shape) for n, t in (adapters or dict(model.named_parameters())).items()}
    tied = not adapters and getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    missing = sorted(set(own) - set(theirs) - ({"lm_head.weight"} if tied else set()))
    unexpected = sorted(set(theirs) - set(own))
    reshaped = [n for n in sorted(set(own) & set(theirs)) if own[n] != theirs[n]]
    if not (missing or unexpected or reshaped):
        return None
    found = [f"{len(missing)} missing (e.g. {missing[:3]})"] if missing else []
    found += [f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})"] if unexpected else []
    found += [f"{len(reshaped)} of another shape (e.g. {reshaped[0]}: {list(theirs[reshaped[0]])} "
              f"in the file, {list(own[reshaped[0]])} in the model)"] if reshaped else []
    file_adapters = bool(theirs) and all(n.rpartition(".")[2] in LORA_PARAMS for n in theirs)
    why = ("it holds LoRA adapters (a run with lora.rank > 0), the model has none"
           if file_adapters and not adapters else
           "it holds full weights (a run with lora.rank = 0), the model takes LoRA adapters"
           if adapters and not file_adapters else "it was written for another model or [lora]")
    return (f"{file} does not fit this {'LoRA learner' if adapters else 'model'}: "
            f"{', '.join(found)}; {why}")
