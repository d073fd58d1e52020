"""Parameter names in a checkpoint file vs in a `CausalLM`, where a family stores them apart.

In memory every MoE family uses Qwen3-MoE's names: the router `mlp.gate`, the experts
`mlp.experts.{e}.{gate,up,down}_proj` (so quantization patterns and routing code are one for
all). Mixtral checkpoints (the Hub's, and what transformers reads) name the same tensors
    model.layers.L.block_sparse_moe.gate                 <-> model.layers.L.mlp.gate
    model.layers.L.block_sparse_moe.experts.E.w1 / w3 / w2 <-> ...mlp.experts.E.gate_proj / up_proj / down_proj
Only whole name components are renamed, so the suffix (`.weight`, or compressed-tensors'
`.weight_scale`) and plain module names (quantization targets) pass through unchanged.
"""

from __future__ import annotations

import re
from typing import TypeVar

V = TypeVar("V")

_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_W = {proj: w for w, proj in _MIXTRAL_PROJ.items()}
_MIXTRAL_IN = re.compile(r"\.block_sparse_moe\.(gate|experts\.(\d+)\.(w1|w2|w3))(?=\.|$)")
_MIXTRAL_OUT = re.compile(r"\.mlp\.(gate|experts\.(\d+)\.(gate_proj|up_proj|down_proj))(?=\.|$)")


def _mixtral_in(m: re.Match) -> str:
    if m.group(1) == "gate":
        return ".mlp.gate"
    return f".mlp.experts.{m.group(2)}.{_MIXTRAL_PROJ[m.group(3)]}"


def _mixtral_out(m: re.Match) -> str:
    if m.group(1) == "gate":
        return ".block_sparse_moe.gate"
    return f".block_sparse_moe.experts.{m.group(2)}.{_MIXTRAL_W[m.group(3)]}"


def name_in_memory(family: str, name: str) -> str:
    """A checkpoint's tensor or module name -> the `CausalLM` name."""
    return _MIXTRAL_IN.sub(_mixtral_in, name) if family == "mixtral" else name


def name_on_disk(family: str, name: str) -> str:
    """A `CausalLM` tensor or module name -> the name the family's checkpoints use."""
    return _MIXTRAL_OUT.sub(_mixtral_out, name) if family == "mixtral" else name


def state_in_memory(family: str, state: dict[str, V]) -> dict[str, V]:
    return {name_in_memory(family, k): v for k, v in state.items()}


def state_on_disk(family: str, state: dict[str, V]) -> dict[str, V]:
    return {name_on_disk(family, k): v for k, v in state.items()}
