"""LoRA adapters on linear layers, quantized or not: y = base(x) + (alpha / r) * B(A(x)).

The base is the layer itself, frozen: a `QuantLinear` in the learner's align mode (fake /
kernel) or the engine's kernel mode, or a plain `nn.Linear` (a naive learner, full-precision
rollouts). `attach_lora` turns each selected layer into its LoRA class in place
(`LoraQuantLinear`, `LoraLinear`: the same object, the same `weight` / `bias` parameters and
names, plus `lora_A` [r, in] and `lora_B` [out, r], fp32), freezes every other parameter of
the model and returns the adapted layers' names. State dict names are `<layer>.lora_A` /
`<layer>.lora_B`: `export_state` / `load_state` / checkpoints carry them like any tensor.

Arithmetic. Without grad (the engine's decode, the learner's replay) both adapter products are
qarl.native's fp32 GEMM on the adapters packed once per version where it runs, else
`batch_invariant_linear` (either way a row's bits never depend on the other rows), added to
the base output of the base's own kernel: the engine and a `kernel`-mode learner holding the same
codes and adapters compute the same bits, so the replay stays exact. With grad (the learner's
gradient pass, whose value the exact replay replaces) they are `F.linear`, the same function up
to summation order, with dropout on the adapter input when `dropout` > 0 (PEFT's
`lora_B(lora_A(dropout(x)))`). The base's weight gets no gradient; its straight-through
backward computes dL/dx only.

Init (`init`): "default" is PEFT's (A Kaiming-uniform as `nn.Linear`, B = 0), "gaussian" is
PEFT's `init_lora_weights="gaussian"` (A ~ N(0, 1/r), B = 0). B = 0 makes the adapted layer the
base layer exactly (the delta is an exact zero added).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qarl import native
from qarl.quant.apply import is_selected
from qarl.quant.kernels import batch_invariant_linear
from qarl.quant.linear import QuantLinear

LORA_PARAMS = ("lora_A", "lora_B")
INITS = ("default", "gaussian", "zeros")  # zeros: an engine copy's, until the first push


def default_alpha(rank: int) -> float:
    """lora.alpha when a recipe leaves it out: 2 x rank (scale 2)."""
    return 2.0 * rank


class LoraLayer:
    """The adapter half of a LoRA layer (a mixin in front of QuantLinear or nn.Linear)."""

    in_features: int
    out_features: int
    lora_A: nn.Parameter  # [r, in] float32
    lora_B: nn.Parameter  # [out, r] float32
    scaling: float  # alpha / r
    lora_dropout: float

    def add_adapter(self, rank: int, alpha: float, dropout: float = 0.0, init: str = "default"):
        if init not in INITS:
            raise ValueError(f"unknown LoRA init {init!r}; valid: {list(INITS)}")
        device = self.weight.device
        a = torch.empty(rank, self.in_features, dtype=torch.float32, device=device)
        if init == "default":
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        elif init == "gaussian":
            nn.init.normal_(a, std=1.0 / rank)
        else:
            a.zero_()
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device))
        self.scaling, self.lora_dropout = alpha / rank, dropout

    @property
    def rank(self) -> int:
        return self.lora_A.shape[0]

    def delta(self, x: Tensor) -> Tensor:  # [M, in] -> scaling * B(A(x)) [M, out] float32
        h = x.float()
        if not torch.is_grad_enabled():
            if _native_ok(self.lora_A, h):  # faster than the 16-row torch.mm tiles at decode
                a, b = (_packed(self, name) for name in LORA_PARAMS)
                return native.linear_f32(native.linear_f32(h, a), b) * self.scaling
            return batch_invariant_linear(batch_invariant_linear(h, self.lora_A),
                                          self.lora_B) * self.scaling
        if self.lora_dropout:
            h = F.dropout(h, self.lora_dropout, training=True)
        return F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling

    def merged_delta(self) -> Tensor:  # scaling * B A: [out, in] float32
        with torch.no_grad():
            return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    def _with_delta(self, x: Tensor, y: Tensor) -> Tensor:
        lead = x.shape[:-1]
        d = self.delta(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)
        return y + d.to(y.dtype)


class LoraQuantLinear(LoraLayer, QuantLinear):
    """A QuantLinear (its scheme, mode and kernel) plus an fp32 adapter."""

    def forward(self, x: Tensor) -> Tensor:
        return self._with_delta(x, QuantLinear.forward(self, x))

    def extra_repr(self) -> str:
        return f"{QuantLinear.extra_repr(self)}, lora_rank={self.rank}, scaling={self.scaling:g}"


class LoraLinear(LoraLayer, nn.Linear):
    """A full-precision nn.Linear plus an fp32 adapter. Without grad its base product is the
    one the engine's decode plan runs for a plain fp32 linear where qarl.native runs (its fp32
    GEMM on the weight packed once per version: batch-invariant, the same bits, so B = 0 gives
    the plain model's engine outputs exactly), else `batch_invariant_linear`; so an engine and
    a replay of it agree bit for bit either way."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            y = F.linear(x, self.weight, self.bias)
        elif _native_ok(self.weight, x):
            y = native.linear_f32(x, _packed(self, "weight"), self.bias)
        else:
            x2 = x.reshape(-1, self.in_features)
            y = batch_invariant_linear(x2, self.weight, self.bias).to(x.dtype)
            y = y.reshape(*x.shape[:-1], self.out_features)
        return self._with_delta(x, y)


    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, lora_rank={self.rank}, scaling={self.scaling:g}"


def _native_ok(w: Tensor, x: Tensor) -> bool:
    """qarl.native's fp32 GEMM (batch-invariant by construction) runs this product."""
    return (native.available() and w.device.type == "cpu" and w.dtype == torch.float32
            and x.dtype == torch.float32 and not w.is_inference())


def _packed(layer: nn.Module, name: str):
    """`layer.<name>` packed for qarl.native, kept while its storage and version hold (an
    optimizer step or an engine's push makes the next call pack again)."""
    w = getattr(layer, name)
    key = (w.data_ptr(), w._version)
    packs = layer.__dict__.setdefault("_packs", {})
    if name not in packs or packs[name][0] != key:
        packs[name] = (key, native.pack_f32(w.detach()))
    return packs[name][1]


def lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def lora_names(model: nn.Module) -> list[str]:
    """State dict names of every adapter tensor (`<layer>.lora_A`, `<layer>.lora_B`)."""
    return list(adapter_state(model))


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """{`<layer>.lora_A` / `.lora_B`: tensor} of every adapter (detached, shared storage)."""
    return {f"{name}.{p}": getattr(layer, p).detach()
            for name, layer in lora_layers(model).items() for p in LORA_PARAMS}


def lora_targets(model: nn.Module, include, exclude) -> dict[str, nn.Module]:
    """The linear layers (plain or QuantLinear) `include` / `exclude` select, by quant's
    matching rules (a router only when a pattern names it)."""
    return {name: m for name, m in model.named_modules()
            if name and type(m) in (nn.Linear, QuantLinear) and is_selected(name, include, exclude)}


def attach_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                include=("model.layers.*",), exclude=(), init: str = "default") -> list[str]:
    """Give every selected linear layer an adapter (in place), freeze everything else; returns
    the adapted layers' names. ValueError, naming the fix, when nothing matches or the rank is
    larger than a layer's smaller side (B A would have rank min(in, out) anyway)."""
    targets = lora_targets(model, tuple(include), tuple(exclude))
    if not targets:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | QuantLinear)]
        raise ValueError(
            f"lora.include = {list(include)} (exclude = {list(exclude)}) matches no linear layer "
            f"of this model; its linear layers look like {linears[:4]}")
    narrow = {n: min(m.in_features, m.out_features) for n, m in targets.items()
              if rank > min(m.in_features, m.out_features)}
    if narrow:
        name, width = min(narrow.items(), key=lambda kv: kv[1])
        raise ValueError(
            f"lora.rank = {rank} is larger than {len(narrow)} target layer(s)' smaller side (e.g. "
            f"{name}: {width}); use a rank of at most {width}, or leave those layers out "
            f"(lora.exclude)")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in targets.values():
        layer.__class__ = LoraQuantLinear if isinstance(layer, QuantLinear) else LoraLinear
        layer.add_adapter(rank, alpha, dropout, init)
    return list(targets)


def load_adapters(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy adapter tensors (`adapter_state`'s names) into the model's; every adapter of the
    model must be given, with its shape."""
    own = adapter_state(model)
    missing, unknown = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unknown:
        raise ValueError(f"adapter state does not fit this model's LoRA layers: "
                         f"{len(missing)} missing (e.g. {missing[:3]}), {len(unknown)} unknown "
                         f"(e.g. {unknown[:3]})")
    with torch.no_grad():
        for name, value in state.items():
            if own[name].shape != value.shape:
                raise ValueError(f"adapter {name}: shape {tuple(value.shape)}, the model's "
                                 f"is {tuple(own[name].shape)} (another rank or layer width)")
            own[name].copy_(value)


def merged_weights(model: nn.Module) -> dict[str, Tensor]:
    """{`<layer>.weight`: W + (alpha / r) B A} of every LoRA layer holding its full-precision
    weight W: the merged full-precision model (a layer of an engine copy, codes only, raises)."""
    out = {}
    for name, layer in lora_layers(model).items():
        weight = layer.weight.detach()
        if isinstance(layer, QuantLinear) and layer.released:
            raise ValueError(f"{name} holds no full-precision weight (an engine copy's codes "
                             "only) to merge the adapter into")
        out[f"{name}.weight"] = (weight.float() + layer.merged_delta()).to(weight.dtype)
    return out


def remove_adapters(model: nn.Module, merge: bool) -> None:
    """Turn every LoRA layer back into its base layer, in place: with `merge`, its weight
    becomes W + (alpha / r) B A (PEFT's merge_and_unload); without, the adapter is dropped and
    the frozen base is left (what the adapter was trained on)."""
    merged = merged_weights(model) if merge else {}
    for name, layer in lora_layers(model).items():
        with torch.no_grad():
            if merge:
                layer.weight.copy_(merged[f"{name}.weight"])
        for p in LORA_PARAMS:
            delattr(layer, p)
        del layer.scaling, layer.lora_dropout
        layer.__dict__.pop("_packs", None)
        layer.__class__ = QuantLinear if isinstance(layer, QuantLinear) else nn.Linear
