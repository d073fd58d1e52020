"""The quantization contract between learner and engine: what each side quantizes.

`layer_table(learner, engine_qweights, quant)`: one row per linear layer of the learner's
model (and per layer only the engine quantizes): its format on the learner (with the
alignment), the format the engine decodes it with, and a verdict. A layer quantized on one
side only, or in another format (scheme, group size, symmetry, shape), is a `mismatch`
unless a `quant.contract_exempt` pattern names it (`exempt`). For a `naive` learner (plain
full precision by design) the engine must quantize exactly the layers the recipe selects
(`quant.scheme` with `quant.include` / `exclude`); the other alignments compare the
learner's QuantLinear layers with the engine's. The matching rules are `quant.include`'s
(qarl.quant.apply: a glob with `*?[`, else a substring). Whether the engine holds what the
learner pushed is `qarl.quant.digests`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from torch import nn

from qarl.quant.apply import DEFAULT_INCLUDE, is_selected, name_matches, quant_layers
from qarl.quant.linear import QuantLinear
from qarl.quant.qweight import QWeight
from qarl.quant.schemes import SCHEMES

FULL_PRECISION = "full precision"


class ContractBroken(RuntimeError):
    """The engine does not decode with what the learner trains (message names the layers)."""


@dataclass(frozen=True)
class LayerRow:
    layer: str  # module name, e.g. model.layers.0.self_attn.q_proj
    learner: str  # its format on the learner, e.g. "w8a8-int8 per-channel sym [576x576] (kernel)"
    engine: str  # the format the engine decodes it with
    status: str  # "ok", "exempt" or "mismatch"


def qweight_format(qw: QWeight) -> str:
    """A QWeight's layout in words: scheme, grouping, symmetry, shape."""
    group = f"g{qw.group_size}" if qw.group_size else "per-channel"
    return (f"{qw.scheme} {group} {'sym' if qw.symmetric else 'asym'} "
            f"[{qw.shape[0]}x{qw.shape[1]}]")


def _linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear | QuantLinear)]


def layer_table(learner: nn.Module, engine_qweights: Mapping[str, QWeight], scheme: str,
                align: str, include: Sequence[str] | None = None,
                exclude: Sequence[str] | None = None,
                exempt: Sequence[str] = ()) -> list[LayerRow]:
    """The contract's rows (module docstring). `engine_qweights`: `Engine.qweights()` (the codes
    and scales it decodes with, per quantized layer); `scheme`, `align`, `include`, `exclude`:
    the recipe's [quant]; `exempt`: patterns of layers allowed to differ."""
    learner_layers = quant_layers(learner)
    identity = SCHEMES[scheme].is_identity
    include = tuple(include) if include is not None else DEFAULT_INCLUDE
    rows = []
    names = _linear_names(learner)
    names += sorted(set(engine_qweights) - set(names))  # quantized by the engine alone
    for name in names:
        held = engine_qweights.get(name)
        engine = qweight_format(held) if held is not None else FULL_PRECISION
        if name in learner_layers:
            layer = learner_layers[name]
            learned = qweight_format(layer.qweight())
            learner_text, same = f"{learned} ({layer.mode})", learned == engine
        elif align == "naive" and not identity and is_selected(name, include, exclude or ()):
            # the naive learner stays full precision; the engine must quantize what is selected
            learner_text = f"{FULL_PRECISION} (naive; the engine quantizes it as {scheme})"
            same = held is not None and held.scheme == scheme
        else:
            learner_text, same = FULL_PRECISION, held is None
        status = "ok" if same else (
            "exempt" if any(name_matches(name, p) for p in exempt) else "mismatch")
        rows.append(LayerRow(name, learner_text, engine, status))
    return rows


def contract_problems(rows: Sequence[LayerRow]) -> list[str]:
    """One line per mismatched row: the layer and both sides' formats."""
    return [f"{r.layer}: learner {r.learner}, engine {r.engine}" for r in rows
            if r.status == "mismatch"]


def check_table(rows: Sequence[LayerRow]) -> None:
    """Raise ContractBroken naming every layer quantized on one side only or differently."""
    problems = contract_problems(rows)
    if problems:
        raise ContractBroken(
            f"{len(problems)} linear layer(s) are not quantized the same way by the learner and "
            f"the engine: {'; '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}. The "
            "engine would sample from another policy than the learner trains. Fix the model or "
            "engine, or, where one side is meant to differ, name the layers in "
            "quant.contract_exempt")


def table_summary(rows: Sequence[LayerRow]) -> str:
    """One line for the log: how many layers in which format, exempt ones named."""
    counts: dict[str, int] = {}
    for r in rows:
        key = r.engine.rsplit(" [", 1)[0] if r.status == "ok" else r.status
        counts[key] = counts.get(key, 0) + 1
    parts = [f"{n} {key}" for key, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    return f"{len(rows)} linear layers, learner = engine: " + ", ".join(parts)


def settings(qw: QWeight) -> str:
    """A QWeight's quantizer settings in words: its format (`qweight_format`) and the dtypes
    of its codes and scales, everything a kernel reads them by."""
    scales = "none" if qw.scales is None else str(qw.scales.dtype).removeprefix("torch.")
    return (f"{qweight_format(qw)}, codes {str(qw.codes.dtype).removeprefix('torch.')}, "
            f"scales {scales}{', zeros' if qw.zeros is not None else ''}"
            f"{', global scale' if qw.global_scale is not None else ''}")


def settings_mismatches(pushed: Mapping[str, object], held: Mapping[str, QWeight]) -> list[str]:
    """'layer: learner <settings>, engine <settings>' for every QWeight of `pushed` (an
    `export_state`, `<layer>.weight` keys) whose quantizer settings differ from those of the
    codes the engine's layer holds (`held`: `Engine.qweights()`, layer keys). A layer the
    engine holds no codes for is the layer table's business, not this check's."""
    out = []
    for key, qw in pushed.items():
        layer = key.removesuffix(".weight")
        if not isinstance(qw, QWeight) or layer not in held:
            continue
        mine, theirs = settings(qw), settings(held[layer])
        if mine != theirs:
            out.append(f"{layer}: learner {mine}, engine {theirs}")
    return out


def table_json(rows: Sequence[LayerRow]) -> list[dict]:
    return [asdict(r) for r in rows]
