"""The engine's decode plan: what runs for each part of a model, built without changing it.

`DecodePlanner.plan(model, batch_hint)` returns a `DecodePlan` whose parts are called in the
order `qarl.model.decoder.decoder_forward` (what `CausalLM.forward` runs) calls the model's own
modules:

- `embed`, `norm`: the model's embedding and final norm modules;
- `steps`: one callable per decoder layer, `step(x, cos, sin, mask, cache, layer, cache_start)`:
  - a fusable block (see `qarl.rollout.prepack.block_source`): `fused_block_forward` on its
    packs; at each decode step that is one `qarl.native.DecodeBlock` call where the packs
    hold one, else the fused steps in PyTorch ops with qarl.native's RMSNorm, SwiGLU product
    and one-call attention step;
  - any other layer: its own forward (`Block.forward` of `qarl/model/decoder.py`), on a shallow
    copy whose plain fp32 linears are `PackedLinear`s when it has any (the copy shares the
    model's parameters, buffers and hooks, and only its own child table differs);
- `lm_head`: a `PackedLinear` where the model's lm_head is a plain fp32 linear, else itself.

The model object is never modified: no module gets an instance `forward` or a hook. Packs are
cached per module with the key they were built from and reused while it matches (see
`qarl.rollout.prepack`); the plan around them is assembled again on every call (one walk over
the model's modules), so a layer replaced or quantized since the last call is planned anew.
`DecodePlanner.paths(model)` says, per module name, what runs (`LocalEngine.describe`); it is
worked out only when asked, never on the generate / score path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from qarl.model.cache import KVCache
from qarl.model.decoder import CausalLM, decoder_forward
from qarl.quant import QuantLinear
from qarl.rollout.fused import BlockPacks, fused_block_forward, linear
from qarl.rollout.prepack import (
    block_linears, block_source, linear_source, pack_path, packable, prepack_available,
)


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a packed weight (qarl.native panels or oneDNN-blocked)."""

    def __init__(self, packed, bias: Tensor | None):
        super().__init__()
        self.packed = packed  # [out, in], packed
        self.bias = bias  # [out] or None: the model's own bias parameter

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> x W^T + b: [..., out]
        return linear(x, self.packed, self.bias)


@dataclass(frozen=True)
class DecodePlan:
    """The callables that compute a `CausalLM`'s hidden states and logits while decoding."""

    embed: Callable  # ids [B, T] int64 -> [B, T, d]
    steps: tuple[Callable, ...]  # per layer: (x [B, T, d], cos, sin, mask, cache, i, start) -> x
    norm: Callable  # [B, T, d] -> [B, T, d]
    lm_head: Callable  # [B, d] -> logits [B, V]
    rope: Callable  # positions [B, T], dtype -> cos, sin [B, 1, T, head_dim]

    def hidden(self, ids: Tensor, positions: Tensor, cache: KVCache, cache_start: int,
               key_mask: Tensor) -> Tensor:
        """`CausalLM.forward` with the plan's parts: ids, positions [B, T] -> [B, T, d]."""
        return decoder_forward(self.embed, self.steps, self.norm, self.rope, ids, positions,
                               cache, cache_start, key_mask)


class DecodePlanner:
    """Builds a model's `DecodePlan` and keeps its packs between calls.

    pack_weights=False plans every module's own forward (no packs); fuse_blocks=False packs
    each plain fp32 linear on its own instead of fusing blocks (for comparison). Costs one
    extra copy of the packed weights in memory and one packing pass per weight version."""

    def __init__(self, pack_weights: bool = True, fuse_blocks: bool = True):
        self.pack_weights = pack_weights
        self.fuse_blocks = fuse_blocks
        self._packs: dict[nn.Module, tuple[tuple | None, object]] = {}

    def plan(self, model: CausalLM, batch_hint: int) -> DecodePlan:
        """The plan for `model`'s current weights; packs first built here are laid out for
        about `batch_hint` rows (oneDNN only)."""
        packs = self._current_packs(model, batch_hint)
        self._packs = packs  # modules no longer packable (e.g. quantized since) are dropped
        return _assemble(model, {module: pack for module, (_, pack) in packs.items()})

    def clear(self) -> None:
        """Drop every pack: the next plan builds them from the weights it finds."""
        self._packs = {}

    def paths(self, model: CausalLM) -> dict[str, str]:
        """Module name -> what the next plan runs for it, without keeping any pack built here
        (so asking never changes later outputs)."""
        packs = self._current_packs(model, batch_hint=1)
        return _paths(model, {module: pack for module, (_, pack) in packs.items()})

    def _current_packs(self, model: CausalLM, batch_hint: int) -> dict:
        packs: dict[nn.Module, tuple[tuple | None, object]] = {}
        if not (self.pack_weights and prepack_available(next(model.parameters()).device)):
            return packs
        fused: set[nn.Module] = set()
        if self.fuse_blocks:
            for module in model.modules():
                source = block_source(module, batch_hint)
                if source is not None:
                    packs[module] = self._cached(module, *source)
                    fused.update(block_linears(module))
        for module in model.modules():
            if module not in fused and packable(module):
                packs[module] = self._cached(module, *linear_source(module, batch_hint))
        return packs

    def _cached(self, module: nn.Module, key, build) -> tuple[object, object]:
        # key: what the pack was built from (None: unknowable, always rebuild)
        cached = self._packs.get(module)
        if key is not None and cached is not None and cached[0] == key:
            return cached
        return key, build()


def _assemble(model: CausalLM, packs: dict[nn.Module, object]) -> DecodePlan:
    linears = {m: PackedLinear(p, m.bias) for m, p in packs.items() if not isinstance(p, BlockPacks)}
    steps = []
    for layer in model.model.layers:
        pack = packs.get(layer)
        if isinstance(pack, BlockPacks):
            steps.append(partial(fused_block_forward, layer, pack))
        else:
            steps.append(_with_packed(layer, linears))
    body = model.model
    return DecodePlan(
        embed=_with_packed(body.embed_tokens, linears), steps=tuple(steps),
        norm=_with_packed(body.norm, linears), lm_head=_with_packed(model.lm_head, linears),
        rope=model.rope,
    )


def _with_packed(module: nn.Module, linears: dict[nn.Module, nn.Module]) -> nn.Module:
    """`module` with each of its submodules found in `linears` replaced by its value: a
    shallow copy of every module on the way (same parameters, buffers and hooks; a new child
    table), `module` itself where nothing is replaced. The model is not modified."""
    if module in linears:
        return linears[module]
    children = {
        name: None if child is None else _with_packed(child, linears)
        for name, child in module._modules.items()
    }
    if all(children[name] is child for name, child in module._modules.items()):
        return module
    copy = object.__new__(type(module))
    copy.__dict__.update(module.__dict__)
    copy.__dict__["_modules"] = children
    return copy


def _paths(model: CausalLM, packs: dict[nn.Module, object]) -> dict[str, str]:
    """Module name -> what runs it: every layer, the linears of unfused layers, the lm_head."""
    paths = {}
    for i, layer in enumerate(model.model.layers):
        name = f"model.layers.{i}"
        pack = packs.get(layer)
        if isinstance(pack, BlockPacks):
            paths[name] = _fused_path(pack)
            continue
        paths[name] = f"own forward ({type(layer).__name__}.forward)"
        for sub_name, sub in layer.named_modules(prefix=name):
            if isinstance(sub, nn.Linear | QuantLinear):
                paths[sub_name] = _linear_path(sub, packs)
    paths["lm_head"] = _linear_path(model.lm_head, packs)
    return paths


def _fused_path(pack: BlockPacks) -> str:
    if pack.native is not None:
        how = "fused block, one qarl.native DecodeBlock call per decode step (prefill: fused steps)"
    else:
        how = ("fused block in PyTorch ops with qarl.native's rms_norm, silu_mul and "
               "decode_attention where they run")
    return f"{how}; q/k/v and gate/up stacked; GEMMs: {pack.gemm_path}"


def _linear_path(module: nn.Module, packs: dict[nn.Module, object]) -> str:
    if module in packs:
        return f"packed linear: {pack_path(packs[module])}"
    if isinstance(module, QuantLinear):
        return f"own forward: {module.kernel_path()}"
    if type(module) is nn.Linear and module.weight.dtype != torch.float32:
        return f"own forward: F.linear in {module.weight.dtype}"
    return f"own forward ({type(module).__name__}.forward)"
