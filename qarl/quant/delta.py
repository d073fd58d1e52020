"""Weight deltas: the codes and scales that changed since the version an engine holds.

After an optimizer step most low-bit codes do not move (`sync/changed_code_frac`): an engine
that holds the previous version needs only the changed ones. `encode_state(held, state)`
compares each QWeight of a new `export_state` with the one the engine holds, part by part
(codes, scales, zeros, global scale), as raw bits in the part's own width: a code byte, a
bf16 or fp32 scale. Packed 4-bit codes are compared per byte, i.e. per pair of codes. Each
changed part is sent in the smallest of three encodings (`encoded_bytes`), for n elements of
w bytes of which c changed:

- `offsets16`: each changed element's offset within its block of 65536 in 16 bits, an int32
  count per block, and the new values: c (2 + w) + 4 ceil(n / 65536) bytes;
- `bitmask`: one bit per element and the new values: ceil(n / 8) + c w bytes;
- `whole`: the part itself, n w bytes (a delta is never larger than the part).

Plain int32 indices (c (4 + w) bytes) never beat `offsets16` and are not an encoding.
Every other tensor of the state (embeddings, norms, full-precision linears) travels whole:
under Adam a trained full-precision tensor moves almost everywhere every step.

`apply_delta(model, delta)` patches the codes and scales a model's QuantLinear layers hold, in
place, and installs them as new QWeights through `load_state`, so every cache and pack built
from the old ones is rebuilt as after a whole push. An engine that takes deltas holds its own
copy of the codes (`owned`, at its whole pushes): never the learner's, which a whole push in
one process would otherwise hand it by reference. Applying a delta to the version it was
encoded against gives that version bit for bit (`tests/unit/quant/test_delta.py`); which
version an engine holds is the engine's to track (`qarl.rollout.protocol.DeltaLoader`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from qarl.quant.apply import load_state, quant_layers
from qarl.quant.qweight import QWeight

PARTS = ("codes", "scales", "zeros", "global_scale")  # a QWeight's tensors
BLOCK = 1 << 16  # offsets16: elements per block (a uint16 offset within it)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # width -> bit view


def _bits(t: Tensor) -> Tensor:  # [n] in the integer dtype of t's width: its raw bits
    if not t.is_contiguous():
        raise ValueError(f"a weight delta needs contiguous tensors; got one of shape "
                         f"{tuple(t.shape)} with strides {t.stride()}")
    return t.detach().reshape(-1).view(_BITS[t.element_size()])


def tensors_bytes(tensors) -> int:
    """Bytes of `tensors`, each storage view once (a tied lm_head is the embedding, and a
    pickle, as Ray's object store takes it, carries it once)."""
    seen = {(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype): t.numel() * t.element_size()
            for t in tensors}
    return sum(seen.values())


def encoded_bytes(numel: int, changed: int, width: int) -> dict[str, int]:
    """Bytes of each encoding of a part of `numel` elements of `width` bytes, `changed` of
    which differ (module docstring); the first of equal sizes is chosen."""
    return {"whole": numel * width,
            "bitmask": math.ceil(numel / 8) + changed * width,
            "offsets16": changed * (2 + width) + 4 * math.ceil(numel / BLOCK)}


@dataclass
class PartDelta:
    """One changed tensor part: its new values at the changed elements, and where they are."""

    encoding: str  # "offsets16", "bitmask" or "whole" (encoded_bytes)
    numel: int  # elements of the part
    changed: int  # elements whose bits differ from the held version
    values: Tensor  # [changed] (whole: [numel]) the new bits, integer dtype of the part's width
    # offsets16: [changed] int16, the bits of each uint16 offset (a uint16 tensor does not
    # survive pickling, which Ray's object store uses); bitmask: [ceil(numel/8)] uint8
    where: Tensor | None = None
    counts: Tensor | None = None  # offsets16: [ceil(numel/BLOCK)] int32 changed per block

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.where, self.counts)
                   if t is not None)


def _pack_bits(mask: Tensor) -> Tensor:
    """[n] bool -> [ceil(n/8)] uint8: bit j of byte i says whether element 8 i + j is set
    (numpy's packbits on the CPU, many times faster than torch's shifts and sums)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    padded = nn.functional.pad(mask, (0, -mask.numel() % 8)).view(-1, 8).to(torch.uint8)
    return (padded << torch.arange(8, dtype=torch.uint8, device=mask.device)).sum(
        1, dtype=torch.uint8)


def _unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of `_pack_bits`: [n] bool."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little")).bool()
    bits = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> bits) & 1).view(-1)[:n].bool()


def encode_part(held: Tensor, new: Tensor) -> PartDelta | None:
    """The change from `held` to `new` (same shape and dtype) in its smallest encoding; None
    when every bit is the same."""
    a, b = _bits(held), _bits(new)
    changed = a != b  # [n] bool
    count = int(torch.count_nonzero(changed))  # (a bool sum would widen to int64 first)
    if count == 0:
        return None
    sizes = encoded_bytes(b.numel(), count, b.element_size())
    encoding = min(sizes, key=sizes.get)
    if encoding == "whole":
        return PartDelta("whole", b.numel(), count, b)
    if encoding == "bitmask":
        return PartDelta("bitmask", b.numel(), count, b[changed], where=_pack_bits(changed))
    index = changed.nonzero().squeeze(1)  # [c] int64, ascending
    counts = torch.bincount(index >> 16, minlength=math.ceil(b.numel() / BLOCK))
    return PartDelta("offsets16", b.numel(), count, b[index],
                     where=(index & (BLOCK - 1)).to(torch.uint16).view(torch.int16),
                     counts=counts.to(torch.int32))


def apply_part(target: Tensor, delta: PartDelta) -> None:
    """Write `delta`'s new values into `target` (the version it was encoded against), in
    place."""
    flat = _bits(target)
    if flat.numel() != delta.numel or flat.dtype != delta.values.dtype:
        raise ValueError(f"a delta of {delta.numel} elements of {delta.values.element_size()} "
                         f"byte(s) cannot go into a tensor of {flat.numel()} of "
                         f"{flat.element_size()}: it was encoded for another layout")
    values = delta.values.to(flat.device)
    if delta.encoding == "whole":
        flat.copy_(values)
    elif delta.encoding == "bitmask":
        flat.masked_scatter_(_unpack_bits(delta.where, flat.numel()).to(flat.device), values)
    else:  # offsets16: block start + offset within it
        starts = torch.arange(len(delta.counts), device=flat.device) * BLOCK
        index = starts.repeat_interleave(delta.counts.to(flat.device).long())
        offsets = delta.where.to(flat.device).long() & (BLOCK - 1)  # the uint16 bits again
        flat.index_put_((index + offsets,), values)


@dataclass
class QWeightDelta:
    """The changed parts of one QWeight (PARTS names); an unchanged part is absent."""

    parts: dict[str, PartDelta]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts.values())


def layout(qw: QWeight) -> tuple:
    """What a delta needs to be equal between two versions: format, grouping, symmetry, shape,
    and each part's presence, shape and dtype."""
    parts = tuple(None if t is None else (tuple(t.shape), t.dtype)
                  for t in (getattr(qw, p) for p in PARTS))
    return qw.scheme, tuple(qw.shape), qw.group_size, qw.symmetric, parts


def encode_qweight(held: QWeight, new: QWeight) -> QWeightDelta:
    """The parts of `new` that differ from `held` (same `layout`)."""
    parts = {}
    for name in PARTS:
        old, now = getattr(held, name), getattr(new, name)
        part = None if now is None else encode_part(old, now)
        if part is not None:
            parts[name] = part
    return QWeightDelta(parts)


@dataclass
class StateDelta:
    """An engine's weights from version `base` to `version`: the changed parts of each
    quantized layer, and every other tensor of the state whole."""

    base: int  # the weight version the engine must hold
    version: int  # the version it holds once the delta is applied
    qweights: dict[str, QWeightDelta]  # `<layer>.weight` -> its changed parts (changed ones only)
    tensors: dict[str, Tensor] = field(default_factory=dict)  # every other entry, whole

    def nbytes(self) -> int:
        """Bytes of the delta: what a push of it moves."""
        return (sum(d.nbytes() for d in self.qweights.values())
                + tensors_bytes(self.tensors.values()))

    def qweight_bytes(self) -> int:
        """Bytes of the quantized layers' part of it (what accumulates over deltas: the other
        tensors of each delta replace the previous delta's)."""
        return sum(d.nbytes() for d in self.qweights.values())

    def changed(self, part: str = "codes") -> int:
        """Elements of `part` that changed, over every quantized layer."""
        return sum(d.parts[part].changed for d in self.qweights.values() if part in d.parts)


def encode_state(held: Mapping[str, QWeight], state: Mapping[str, Tensor | QWeight],
                 base: int, version: int) -> StateDelta | None:
    """The delta from `held` (the QWeights of the state pushed as version `base`, by
    `<layer>.weight` name) to `state` (an `export_state`); None where a QWeight of `state` has
    no counterpart of the same `layout` in `held` (then only a whole push is exact)."""
    qweights, tensors = {}, {}
    for key, value in state.items():
        if not isinstance(value, QWeight):
            tensors[key] = value
            continue
        before = held.get(key)
        if before is None or layout(before) != layout(value):
            return None
        change = encode_qweight(before, value)
        if change.parts:
            qweights[key] = change
    return StateDelta(base, version, qweights, tensors)


def owned(state: Mapping[str, Tensor | QWeight]) -> dict[str, Tensor | QWeight]:
    """`state` with each QWeight's tensors copied: an engine that patches its codes in place
    must not share them with the learner (whose previous push is the next delta's base) or
    with a buffer it was handed."""
    copy = lambda t: None if t is None else t.clone()  # noqa: E731
    return {k: QWeight(v.scheme, v.shape, copy(v.codes), copy(v.scales), copy(v.zeros),
                       copy(v.global_scale), v.group_size, v.symmetric)
            if isinstance(v, QWeight) else v for k, v in state.items()}


def patched(qw: QWeight, delta: QWeightDelta | None) -> QWeight:
    """`qw` with `delta` written into its tensors in place, as a new QWeight object (a kernel's
    prepared operands and an engine's packs are keyed by the QWeight: none survives)."""
    if delta is None:
        return qw
    for name, part in delta.parts.items():
        apply_part(getattr(qw, name), part)
    return QWeight(qw.scheme, qw.shape, qw.codes, qw.scales, qw.zeros, qw.global_scale,
                   qw.group_size, qw.symmetric)


def apply_delta(model: nn.Module, delta: StateDelta) -> None:
    """Install `delta` into `model`, an engine model holding the version it was encoded
    against: each changed QWeight patched in place and every layer's QWeight installed again
    (`load_state`: the other tensors copied first), as a whole push installs them."""
    layers = quant_layers(model)
    held = {f"{name}.weight": layer.qweight() for name, layer in layers.items()}
    unknown = sorted(set(delta.qweights) - set(held))
    if unknown:
        raise KeyError(f"apply_delta: {len(unknown)} layer(s) of the delta are not quantized "
                       f"layers of this model: {unknown[:5]}; a delta goes to an engine built "
                       "like the learner (quantize_model with its scheme)")
    state: dict[str, Tensor | QWeight] = dict(delta.tensors)
    state.update({key: patched(qw, delta.qweights.get(key)) for key, qw in held.items()})
    load_state(model, state)
