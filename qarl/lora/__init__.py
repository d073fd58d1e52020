"""LoRA: low-rank adapters on the frozen, quantized base, and their PEFT folders.

- `layers`: the adapted layers (`LoraQuantLinear`, `LoraLinear`: y = base(x) + (alpha / r)
  B A x), `attach_lora`, the adapters' names and state, merging and removing them;
- `peft`: PEFT folders out (`write_peft`, the `qarl export --format peft` of a LoRA run) and
  in (`import_peft`, recipe `lora.init_from`), with the checks a recipe runs on a folder;
- `recipe`: a recipe's `[lora]` applied to a learner or an engine's copy;
- `fit`: whether a checkpoint's weights fit a model (LoRA or full), from the file's header.

The base stays in the rollout format on both sides; only the adapters train and, after the
first weight push, only they travel to the engine (docs/lora.md).
"""

from qarl.lora.layers import (
    LoraLayer, LoraLinear, LoraQuantLinear, adapter_state, attach_lora, load_adapters,
    lora_layers, lora_names, merged_weights, remove_adapters,
)

__all__ = [
    "LoraLayer", "LoraLinear", "LoraQuantLinear", "adapter_state", "attach_lora",
    "load_adapters", "lora_layers", "lora_names", "merged_weights", "remove_adapters",
]
