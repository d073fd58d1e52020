"""QWeight: one quantized weight matrix (codes + scales + layout), the unit pushed to engines.

A QWeight is plain data. It knows how to turn itself into a flat dict of tensors (for
safetensors, or a wire format) and back; the math that reads it lives in its scheme
(`SCHEMES[qw.scheme]`).
Kernel-ready operands (packed int4, transposed codes) are derived lazily per device and kept
in `prepared`, which is never serialized: it is a cache of a pure function of the codes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import Tensor

_LAYOUT_KEY = "layout"  # uint8 tensor holding the JSON layout, so one dict round-trips


@dataclass
class QWeight:
    """A quantized [out_features, in_features] weight: N out, K in. Which fields a format
    fills, with which shapes and dtypes, is written on its scheme class (qarl/quant/schemes*.py);
    the fields below are the union."""

    scheme: str  # SCHEMES key
    shape: tuple[int, int]  # (N, K) of the dequantized weight
    codes: Tensor
    scales: Tensor | None = None
    zeros: Tensor | None = None
    global_scale: Tensor | None = None
    group_size: int = 0  # elements along K sharing a scale (a block edge); 0 = per output channel
    symmetric: bool = True
    prepared: dict = field(default_factory=dict, repr=False, compare=False)

    def tensors(self, prefix: str = "") -> dict[str, Tensor]:
        """Flat {prefix + name: tensor}, including a uint8 JSON `layout` tensor."""
        out = {prefix + "codes": self.codes}
        for name in ("scales", "zeros", "global_scale"):
            value = getattr(self, name)
            if value is not None:
                out[prefix + name] = value
        layout = {
            "scheme": self.scheme, "shape": list(self.shape),
            "group_size": self.group_size, "symmetric": self.symmetric,
        }
        out[prefix + _LAYOUT_KEY] = torch.tensor(list(json.dumps(layout).encode()), dtype=torch.uint8)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], prefix: str = "") -> "QWeight":
        """Inverse of `tensors()`: the same codes and scales, bit for bit."""
        key = prefix + _LAYOUT_KEY
        if key not in tensors:
            raise KeyError(
                f"no {key!r} entry among {sorted(tensors)[:8]}...; pass the dict produced by "
                f"QWeight.tensors() with the same prefix"
            )
        layout = json.loads(bytes(tensors[key].tolist()).decode())
        return cls(
            scheme=layout["scheme"],
            shape=tuple(layout["shape"]),
            codes=tensors[prefix + "codes"],
            scales=tensors.get(prefix + "scales"),
            zeros=tensors.get(prefix + "zeros"),
            global_scale=tensors.get(prefix + "global_scale"),
            group_size=layout["group_size"],
            symmetric=layout["symmetric"],
        )

    def to(self, device) -> "QWeight":
        """The same QWeight with every tensor moved to `device` (no re-quantization)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QWeight(
            self.scheme, self.shape, move(self.codes), move(self.scales), move(self.zeros),
            move(self.global_scale), self.group_size, self.symmetric,
        )

    def nbytes(self) -> int:
        """Bytes of the serialized codes and scales (what a push moves)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())
