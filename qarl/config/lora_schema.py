"""The `[lora]` section: low-rank adapters on the frozen, quantized base (qarl/lora/layers.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from qarl.config.section import SECTION as _SECTION
from qarl.lora.layers import default_alpha


class LoraSection(BaseModel):
    """LoRA: train low-rank adapters instead of the full weights. The base model stays frozen
    in the rollout format (the learner's align mode; the engine serves the same codes), the
    adapters train in fp32 with the recipe's optimizer and learning rate, and after each
    optimizer step only the adapters go to the engine; checkpoints hold the adapters and their
    optimizer state. `qarl export --format peft` writes the adapter as a PEFT folder. rank = 0
    (the default) trains the full weights."""

    model_config = _SECTION

    rank: int = Field(0, ge=0, description="Adapter rank r; 0 turns LoRA off (full fine-tuning). "
                      "At most the smaller side of every target layer.")
    alpha: float | None = Field(None, gt=0, description="Scale numerator: the adapter adds "
                                "(alpha / rank) * B A x. Default: 2 x rank (scale 2).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input in the "
                           "gradient pass only (PEFT's lora_dropout); the engine and the replay "
                           "never drop.")
    include: list[str] = Field(
        ["model.layers.*"],
        description="Target layers, matched as quant.include matches (a glob over module names, "
        "or a plain substring such as 'q_proj'); default every projection of every block "
        "(MoE experts included; a router only when a pattern ends in 'mlp.gate').")
    exclude: list[str] = Field([], description="Layers left without an adapter, matched as "
                               "include; applied after include.")
    init: Literal["default", "gaussian"] = Field(
        "default", description="default: A Kaiming-uniform, B = 0 (PEFT's default); gaussian: "
        "A ~ N(0, 1/rank), B = 0. B = 0 starts the run at the base model's policy exactly.")
    init_from: str | None = Field(
        None, description="A PEFT LoRA adapter folder (adapter_config.json + "
        "adapter_model.safetensors) to start from instead of a fresh init: its rank, alpha and "
        "target layers must be this section's, its tensor shapes the model's.")

    def scale_alpha(self) -> float:
        """alpha, its default filled in (2 x rank)."""
        return float(self.alpha) if self.alpha is not None else default_alpha(self.rank)
