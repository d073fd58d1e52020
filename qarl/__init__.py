"""qarl: reinforcement learning of LLMs with quantized rollouts and a rollout-aligned learner.

The public API (names kept stable; see README):

    model = qarl.load_model("smollm2-135m")
    tok = qarl.load_tokenizer("smollm2-135m")
    qarl.quantize_model(model, "w8a8-int8", mode="kernel")
    engine = qarl.LocalEngine(model)
    batch = engine.generate(prompt_ids, qarl.SamplingParams(max_new_tokens=32), seed=0)
    loss, metrics = qarl.LOSSES["tbpo"](logp, old_logp, rollout_logp, advantages, mask)
    qarl.train("recipes/default.toml", overrides={"train.steps": 5})

Names are resolved lazily so `import qarl` stays cheap and the CLI starts fast.
"""

from __future__ import annotations

import importlib
import os
import sys

__version__ = "0.1.0"

# torch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at its first allocation, so huge pages
# for large tensors are asked for here, before any qarl module imports torch (why, what it
# measures and the opt-outs: qarl/native/memory.py).
if os.environ.get("QARL_MALLOC", "") != "default" and "torch" not in sys.modules:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qarl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
