"""qarl: reinforcement learning of LLMs with quantized rollouts and a rollout-aligned learner.

The public API (names kept stable; see README):

    model = qarl.load_model("smollm2-135m")
    tok = qarl.load_tokenizer("smollm2-135m")
    qarl.quantize_model(model, "w8a8-int8", mode="kernel")
    engine = qarl.LocalEngine(model)
    batch = engine.generate(prompt_ids, qarl.SamplingParams(max_new_tokens=32), seed=0)
    loss, metrics = qarl.LOSSES["tbpo"](logp, old_logp, rollout_logp, advantages, mask)
    qarl.train("recipes/default.toml", overrides={"train.steps": 5})

Names are resolved lazily so `import qarl` stays cheap and the CLI starts fast. Importing
qarl changes nothing in the process (docs/performance.md lists what qarl does where).
"""

from __future__ import annotations

import importlib
import os
import sys

__version__ = "0.1.0"

_EXPORTS = {
    "SamplingParams": "qarl.types",
    "RolloutBatch": "qarl.types",
    "load_model": "qarl.model",
    "load_tokenizer": "qarl.model",
    "LocalEngine": "qarl.rollout",
    "Engine": "qarl.rollout",
    "register_scheme": "qarl.quant",
    "quantize_model": "qarl.quant",
    "SCHEMES": "qarl.quant",
    "LOSSES": "qarl.algo",
    "CORRECTIONS": "qarl.algo",
    "train": "qarl.train",
}

__all__ = sorted(_EXPORTS) + ["__version__", "ask_huge_pages"]


def ask_huge_pages() -> bool:
    """Ask torch's CPU allocator to back large tensors with transparent huge pages (a training
    step's tensors then fault in 2 MiB pages, not 4 KiB ones: qarl/native/memory.py). torch
    reads THP_MEM_ALLOC_ENABLE once, at its first allocation, so this sets it only before
    torch is imported, and not under QARL_MALLOC=default or where the variable is already
    set. The `qarl` command calls it first thing; a program that imports torch itself calls
    it before. -> whether huge pages are asked for in this process."""
    if "torch" not in sys.modules and os.environ.get("QARL_MALLOC", "") != "default":
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qarl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
