"""Whole-model verbs: quantize_model, export_state, load_state, describe.

Layer selection: a pattern with a wildcard (`*?[`) is an fnmatch glob over the module name
(`model.layers.*.mlp.*`); a plain string matches names that contain it (`q_proj`, `lm_head`),
as the recipe's `quant.include` / `quant.exclude` document. Default: every nn.Linear inside
the blocks (`model.layers.*`); `lm_head` is opt-in through `include`. Embeddings stay full
precision (weight-only embedding quantization is not implemented).

Mixture-of-experts layers (`qarl.model.moe`): every expert's three projections
(`model.layers.*.mlp.experts.*.{gate,up,down}_proj`) are ordinary linears, selected like any
other. The router (`model.layers.*.mlp.gate`) stays full precision unless an include pattern
ending in `mlp.gate` names it (e.g. `include = ["model.layers.*"`, `"mlp.gate"]`): its top-k
decides which experts run, so its rounding moves whole experts, not values.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import Tensor, nn

from qarl.quant.linear import QuantLinear, check_mode
from qarl.quant.qweight import QWeight
from qarl.quant.schemes import Scheme, make_scheme

DEFAULT_INCLUDE = ("model.layers.*",)
# Sibling layers a serving engine runs as one fused GEMM (vLLM's qkv_proj, gate_up_proj).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
ROUTER_SUFFIX = "mlp.gate"  # a MoE router's module name ends so (experts end in *_proj)


def name_matches(name: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch(name, pattern)
    return pattern in name


def is_selected(name: str, include, exclude) -> bool:
    if name.endswith("." + ROUTER_SUFFIX):  # a router: only when a pattern names it
        include = [p for p in include if p.endswith(ROUTER_SUFFIX)]
    return (any(name_matches(name, p) for p in include)
            and not any(name_matches(name, p) for p in exclude))


def quantize_model(
    model: nn.Module,
    scheme: str | Scheme,
    mode: str = "kernel",
    include: list[str] | tuple[str, ...] | None = None,
    exclude: list[str] | tuple[str, ...] | None = None,
    **options,
) -> nn.Module:
    """Swap the selected nn.Linear layers for QuantLinear(scheme, mode), in place; returns model.

    `options` go to the scheme (e.g. group_size=128, symmetric=False for the int4 formats).
    Layers already quantized are switched to the new scheme/mode. Raises if nothing matched.
    """
    scheme = make_scheme(scheme, **options)
    check_mode(mode)
    include = tuple(include) if include is not None else DEFAULT_INCLUDE
    exclude = tuple(exclude or ())
    swapped = 0
    for name, module in list(model.named_modules()):
        if not name or not is_selected(name, include, exclude):
            continue
        if isinstance(module, QuantLinear):
            module.scheme, module.mode = scheme, mode
            module.forget()
            swapped += 1
        elif type(module) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, QuantLinear.from_linear(module, scheme, mode))
            swapped += 1
    if swapped == 0:
        raise ValueError(
            f"quantize_model matched no nn.Linear with include={list(include)} "
            f"exclude={list(exclude)}; linear layers in this model look like "
            f"{[n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:4]}"
        )
    link_fused_peers(model)
    return model


def link_fused_peers(model: nn.Module) -> None:
    """Tell each QuantLinear of a FUSED_GROUPS group the group's other QuantLinears of the same
    scheme (a format with a per-tensor number, NVFP4, then gives them one); others get ()."""
    layers = quant_layers(model)
    for name, layer in layers.items():
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED_GROUPS if leaf in g), ())
        peers = [layers.get(f"{parent}.{m}" if parent else m) for m in group if m != leaf]
        peers = tuple(p for p in peers if p is not None and p.scheme == layer.scheme)
        if [id(p) for p in peers] != [id(p) for p in layer.fused_peers]:
            layer.fused_peers = peers
            layer.forget()  # its codes were quantized without the group's scale


def quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def release_masters(model: nn.Module) -> int:
    """`QuantLinear.release_master` on every QuantLinear whose weight no other module shares
    (a tied lm_head keeps the embedding's) and, for a format whose fused group shares one
    scale, whose whole group can be released: the model keeps its codes and scales and takes
    only QWeights from then on (`load_state`). Returns the bytes freed."""
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    layers = [layer for layer in quant_layers(model).values() if not layer.released]
    untied = {id(layer) for layer in layers if owners[id(layer.weight)] == 1}
    chosen = [layer for layer in layers if id(layer) in untied and all(
        id(peer) in untied for peer in layer.fused_peers)]
    current = [layer.qweight() for layer in chosen]  # all quantized before any is released
    freed = 0
    for layer, qw in zip(chosen, current):
        freed += layer.weight.numel() * layer.weight.element_size()
        layer.release_master(qw)
    return freed


def export_state(model: nn.Module) -> dict[str, Tensor | QWeight]:
    """Everything an engine needs: `<layer>.weight` -> QWeight for each QuantLinear (quantized
    once per weight version), every other parameter / persistent buffer as a tensor."""
    layers = quant_layers(model)
    state: dict[str, Tensor | QWeight] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        owner, _, leaf = key.rpartition(".")
        if owner in layers and leaf == "weight":
            state[key] = layers[owner].qweight()
        else:
            state[key] = value.detach()
    return state


def load_state(model: nn.Module, state: dict[str, Tensor | QWeight], strict: bool = True) -> None:
    """Install `state` (from export_state): QWeights go into their QuantLinear as-is, never
    re-quantized; tensors are copied into parameters/buffers. Tensors are copied first, so a
    weight tied to a quantized layer (embedding / lm_head) does not invalidate its QWeight.
    """
    layers = quant_layers(model)
    targets = model.state_dict(keep_vars=True)
    unknown = sorted(set(state) - set(targets))
    missing = sorted(set(targets) - set(state)) if strict else []
    if unknown or missing:
        raise KeyError(
            f"load_state: {len(unknown)} unknown name(s) {unknown[:5]}, {len(missing)} missing "
            f"name(s) {missing[:5]}; the state must come from export_state of the same "
            f"architecture (pass strict=False for a partial update)"
        )
    qweights = {}
    with torch.no_grad():
        for key, value in state.items():
            if isinstance(value, QWeight):
                owner, _, leaf = key.rpartition(".")
                if owner not in layers or leaf != "weight":
                    raise TypeError(
                        f"load_state: {key!r} holds a QWeight but is not the weight of a "
                        f"QuantLinear; quantize the engine model with the learner's "
                        f"quantize_model call first"
                    )
                qweights[owner] = value
                continue
            target = targets[key]
            owner, _, leaf = key.rpartition(".")
            if owner in layers and leaf == "weight" and layers[owner].released:
                raise TypeError(
                    f"load_state: {key!r} is a full-precision tensor, but this model's layer "
                    f"released its master weight and takes QWeights only (export_state of an "
                    f"aligned learner); build the engine without release_masters to push "
                    f"full-precision weights")
            if target.shape != value.shape:
                raise ValueError(
                    f"load_state: {key!r} has shape {tuple(value.shape)}, the model expects "
                    f"{tuple(target.shape)}"
                )
            target.copy_(value)
    for owner, qw in qweights.items():
        layers[owner].install(qw)


def describe(model: nn.Module) -> dict[str, str]:
    """{layer name: "scheme/mode: kernel path and why"} for every QuantLinear (for logs), with
    "; backward on codes" where the layer's backward multiplies on them."""
    return {
        name: f"{layer.scheme.name}/{layer.mode}: {layer.kernel_path()}"
        + ("; backward on codes" if layer.backward == "codes" else "")
        for name, layer in quant_layers(model).items()
    }

