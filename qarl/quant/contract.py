"""The quantization contract between learner and engine: what each side quantizes, and whether
the engine holds what the learner pushed.

- `layer_table(learner, engine_qweights, quant)`: one row per linear layer of the learner's
  model (and per layer only the engine quantizes): its format on the learner (with the
  alignment), the format the engine decodes it with, and a verdict. A layer quantized on one
  side only, or in another format (scheme, group size, symmetry, shape), is a `mismatch`
  unless a `quant.contract_exempt` pattern names it (`exempt`). For a `naive` learner (plain
  full precision by design) the engine must quantize exactly the layers the recipe selects
  (`quant.scheme` with `quant.include` / `exclude`); the other alignments compare the
  learner's QuantLinear layers with the engine's.
- `state_digests(state)`: per pushed name, a CRC-32 of each part of what a weight sync sends
  (a QWeight: codes, scales, zeros, global scale, layout; a tensor: its bytes); engines compute
  the same of what they hold (`engine_digests`, behind `Engine.weight_digests`), and
  `digest_mismatches` names every layer whose parts differ: a dropped, stale or altered layer
  after a sync. Each storage is hashed once (a tied lm_head is the embedding), on torch's
  threads (zlib releases the GIL); an accidental collision has probability 2^-32 per part.
The matching rules are `quant.include`'s (qarl.quant.apply: a glob with `*?[`, else a
substring).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from qarl.quant.apply import DEFAULT_INCLUDE, is_selected, name_matches, quant_layers
from qarl.quant.linear import QuantLinear
from qarl.quant.qweight import QWeight
from qarl.quant.schemes import SCHEMES

FULL_PRECISION = "full precision"
QWEIGHT_PARTS = ("codes", "scales", "zeros", "global_scale", "layout")
CODES_SUFFIX = ":codes"  # an engine layer's codes next to its master weight (see engine_digests)


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


def table_json(rows: Sequence[LayerRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def tensor_crc(t: Tensor) -> int:
    """CRC-32 of a tensor's bytes (any dtype, any device: copied to the CPU when needed)."""
    t = t.detach().reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def _crcs(tensors: list[Tensor | None]) -> list[int]:
    """tensor_crc of each (0 for None), each storage view once (a tied lm_head is the
    embedding), on torch's thread count: zlib releases the GIL while it hashes."""
    keys = [None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
            for t in tensors]
    unique = {k: t for k, t in zip(keys, tensors) if k is not None}
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        crcs = dict(zip(unique, pool.map(tensor_crc, unique.values())))
    return [0 if k is None else crcs[k] for k in keys]


def _parts(value: Tensor | QWeight) -> list[Tensor | None]:
    if isinstance(value, QWeight):
        return [value.codes, value.scales, value.zeros, value.global_scale]
    return [value]


def _digests(entries: dict[str, Tensor | QWeight]) -> dict[str, tuple[int, ...]]:
    """{key: one CRC per part (QWEIGHT_PARTS for a QWeight, its layout's last; one for a
    tensor)}, every tensor hashed in one pass."""
    parts = {k: _parts(v) for k, v in entries.items()}
    flat = _crcs([t for p in parts.values() for t in p])
    out, i = {}, 0
    for key, value in entries.items():
        n = len(parts[key])
        crcs = tuple(flat[i:i + n])
        i += n
        if isinstance(value, QWeight):
            layout = f"{value.scheme}|{value.shape}|{value.group_size}|{value.symmetric}"
            crcs = (*crcs, zlib.crc32(layout.encode()))
        out[key] = crcs
    return out


def state_digests(state: Mapping[str, Tensor | QWeight]) -> dict[str, tuple[int, ...]]:
    """What the engine must hold after installing `state` (an `export_state`), per name; a
    QWeight is keyed `<name>:codes`, as `engine_digests` keys what a layer decodes with."""
    return _digests({(k + CODES_SUFFIX if isinstance(v, QWeight) else k): v
                     for k, v in state.items()})


def engine_digests(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The digests of what an engine model holds, keyed like `state_digests`: every parameter
    and persistent buffer by its name (a quantized layer's master weight only while it has
    one), and each QuantLinear's codes and scales, the ones it decodes with, as
    `<layer>.weight:codes`."""
    layers = quant_layers(model)
    held: dict[str, Tensor | QWeight] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        owner, _, leaf = key.rpartition(".")
        if owner in layers and leaf == "weight":
            layer = layers[owner]
            held[key + CODES_SUFFIX] = layer.qweight()
            if layer.released:
                continue
        held[key] = value
    return _digests(held)


def digest_mismatches(expected: Mapping[str, tuple[int, ...]],
                      held: Mapping[str, tuple[int, ...]]) -> list[str]:
    """`name (parts)` for every expected entry the engine lacks or holds otherwise."""
    out = []
    for key, want in expected.items():
        have = held.get(key)
        if have == want:
            continue
        quantized = key.endswith(CODES_SUFFIX)
        name = key.removesuffix(CODES_SUFFIX).removesuffix(".weight") if quantized else key
        if have is None:
            what = "missing"
        elif quantized:
            what = ", ".join(p for p, a, b in zip(QWEIGHT_PARTS, want, have) if a != b)
        else:
            what = "values"
        out.append(f"{name} ({what})")
    return out
