"""qarl's QWeights in compressed-tensors' layout: the tensor names, dtypes and shapes vLLM
loads, and the `quantization_config` block of config.json that tells it how to read them.

The codes and scales are qarl's own, moved into another container, never re-quantized: a
weight vLLM decodes from these tensors is the weight qarl's engine decodes from the QWeight.
Per qarl scheme (N out, K in, g the int4 group size):

| qarl scheme | format | tensors |
|---|---|---|
| `w8a8-int8` | int-quantized | weight int8 [N, K], weight_scale fp32 [N, 1] |
| `w8a8-fp8` | float-quantized | weight e4m3 [N, K], weight_scale fp32 [N, 1] |
| `w8a8-fp8-block` | float-quantized | weight e4m3 [N, K], weight_scale fp32 [ceil(N/128), ceil(K/128)] |
| `w4a16-int4` (symmetric) | pack-quantized | weight_packed int32 [N, K/8], weight_scale bf16 [N, K/g], weight_shape int64 [2] |
| `w4a8-int` (symmetric) | int-quantized | weight int8 [N, K] in [-8, 7], weight_scale bf16 [N, K/g] |
| `w4a16-nvfp4` | nvfp4-pack-quantized | weight_packed uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_global_scale fp32 [1] |

Conventions checked against compressed-tensors' source (0.17): `pack_to_int32` stores
q + 8 as an unsigned nibble, element 8j + i of a row in bits 4i..4i+3 of int32 j (qarl's u =
q + 8, low nibble first, is the same order); `pack_fp4_to_uint8` puts element 2i in the low
nibble, sign in bit 3 (qarl's FP4 codes exactly); the NVFP4 decode divides the E4M3 scale by
`weight_global_scale` (w = e2m1 * s / g, qarl's g = 448 * 6 / max|w|). w4a8 is `int-quantized`
because compressed-tensors packs only weight-only schemes; vLLM reads it as
`CompressedTensorsW4A8Int` (int4 group weights, dynamic int8 per-token activations).

Asymmetric int4 is refused: qarl's zero point is a bf16 float (w = (u - 8) s + z), and
compressed-tensors only stores integer zero points, so no file of it decodes to qarl's weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file
from torch import Tensor

from qarl.errors import UserError
from qarl.quant import QWeight

WEIGHTS_FILE = "model.safetensors"
_EMBEDDING = "embed_tokens"  # the one 2-D weight that is not a linear layer's


def _args(num_bits: int, kind: str, strategy: str, dynamic: bool, **extra) -> dict:
    """A compressed-tensors QuantizationArgs as JSON (symmetric always: qarl writes no zeros)."""
    return dict(num_bits=num_bits, type=kind, symmetric=True, strategy=strategy,
                dynamic=dynamic, **extra)


INT8_TOKEN = _args(8, "int", "token", True)
FP8_TOKEN = _args(8, "float", "token", True)


def _int4_weights(qw: QWeight) -> dict:
    return _args(4, "int", "group", False, group_size=qw.group_size)


@dataclass(frozen=True)
class CtLayout:
    """How one qarl scheme sits in compressed-tensors: the format, the quantization args of
    weights and input activations, and the tensor conversion both ways."""

    format: str
    weights: Callable[[QWeight], dict]  # QuantizationArgs of this QWeight's weights
    input_activations: dict | None
    to_ct: Callable[[QWeight], dict[str, Tensor]]
    from_ct: Callable[[dict[str, Tensor], dict], QWeight]  # (leaves, weights args) -> QWeight


# ---- the conversions, one pair per scheme ---------------------------------------------------

def pack_int4_to_int32(u: Tensor) -> Tensor:
    """qarl's int4 codes, unpacked: u [N, K] in [0, 15] (= q + 8) -> [N, K/8] int32, element
    8j + i in bits 4i..4i+3 of word j (compressed-tensors' pack_to_int32 with its +8 offset)."""
    N, K = u.shape
    if K % 8:
        raise UserError(f"pack-quantized int4 needs K % 8 == 0, got K={K}")
    shifts = torch.arange(8, dtype=torch.int64) * 4  # [8]
    words = (u.reshape(N, K // 8, 8).to(torch.int64) << shifts).sum(-1)  # [N, K/8] in [0, 2^32)
    # the same bits as a signed int32 (two's complement)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4_from_int32(packed: Tensor) -> Tensor:
    """Inverse of pack_int4_to_int32: [N, K/8] int32 -> u [N, K] uint8 in [0, 15]."""
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = packed.to(torch.int64) & 0xFFFFFFFF  # [N, K/8]
    return ((words[..., None] >> shifts) & 15).to(torch.uint8).reshape(packed.shape[0], -1)


def _unpack_nibbles(p: Tensor) -> Tensor:  # [N, K/2] uint8 -> [N, K] uint8, low nibble first
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1)


def _pack_nibbles(u: Tensor) -> Tensor:  # [N, K] uint8 in [0, 15] -> [N, K/2] uint8
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _require_symmetric(qw: QWeight) -> None:
    if not qw.symmetric or qw.zeros is not None:
        raise UserError(
            f"{qw.scheme} with symmetric=False cannot be written in compressed-tensors: qarl's "
            f"asymmetric int4 has a bf16 float zero point (w = (u - 8) s + z) and "
            f"compressed-tensors stores only integer zero points, so the file would decode to "
            f"other weights. Train (or export with --scheme) {qw.scheme} with "
            f"quant.options.symmetric = true, or export full precision with --format hf."
        )


def _per_channel(qw: QWeight) -> dict[str, Tensor]:
    return {"weight": qw.codes, "weight_scale": qw.scales.float().reshape(-1, 1)}  # [N, 1]


def _from_per_channel(scheme: str) -> Callable[[dict[str, Tensor], dict], QWeight]:
    def read(t: dict[str, Tensor], weights: dict) -> QWeight:
        codes = t["weight"]
        return QWeight(scheme, tuple(codes.shape), codes, t["weight_scale"].reshape(-1))
    return read


def _fp8_block(qw: QWeight) -> dict[str, Tensor]:
    return {"weight": qw.codes, "weight_scale": qw.scales}  # [ceil(N/128), ceil(K/128)]


def _from_fp8_block(t: dict[str, Tensor], weights: dict) -> QWeight:
    codes = t["weight"]
    return QWeight("w8a8-fp8-block", tuple(codes.shape), codes, t["weight_scale"],
                   group_size=weights["block_structure"][1])


def _int4_packed(qw: QWeight) -> dict[str, Tensor]:
    _require_symmetric(qw)
    return {"weight_packed": pack_int4_to_int32(_unpack_nibbles(qw.codes)),
            "weight_scale": qw.scales,  # [N, K/g] bf16, as qarl computed them
            "weight_shape": torch.tensor(qw.shape, dtype=torch.int64)}


def _from_int4_packed(t: dict[str, Tensor], weights: dict) -> QWeight:
    shape = tuple(int(x) for x in t["weight_shape"])
    u = unpack_int4_from_int32(t["weight_packed"])[:, :shape[1]]
    return QWeight("w4a16-int4", shape, _pack_nibbles(u), t["weight_scale"],
                   group_size=weights["group_size"])


def _int4_unpacked(qw: QWeight) -> dict[str, Tensor]:
    _require_symmetric(qw)
    q = _unpack_nibbles(qw.codes).to(torch.int8) - 8  # [N, K] int8 in [-8, 7]
    return {"weight": q, "weight_scale": qw.scales}


def _from_int4_unpacked(t: dict[str, Tensor], weights: dict) -> QWeight:
    u = (t["weight"] + 8).to(torch.uint8)  # [N, K] in [0, 15]
    return QWeight("w4a8-int", tuple(u.shape), _pack_nibbles(u), t["weight_scale"],
                   group_size=weights["group_size"])


def _nvfp4(qw: QWeight) -> dict[str, Tensor]:
    return {"weight_packed": qw.codes, "weight_scale": qw.scales,
            "weight_global_scale": qw.global_scale.float().reshape(1)}


def _from_nvfp4(t: dict[str, Tensor], weights: dict) -> QWeight:
    packed = t["weight_packed"]
    return QWeight("w4a16-nvfp4", (packed.shape[0], 2 * packed.shape[1]), packed,
                   t["weight_scale"], global_scale=t["weight_global_scale"].reshape(()),
                   group_size=16)


LAYOUTS: dict[str, CtLayout] = {
    "w8a8-int8": CtLayout("int-quantized", lambda qw: _args(8, "int", "channel", False),
                          INT8_TOKEN, _per_channel, _from_per_channel("w8a8-int8")),
    "w8a8-fp8": CtLayout("float-quantized", lambda qw: _args(8, "float", "channel", False),
                         FP8_TOKEN, _per_channel, _from_per_channel("w8a8-fp8")),
    "w8a8-fp8-block": CtLayout(
        "float-quantized",
        lambda qw: _args(8, "float", "block", False, block_structure=[qw.group_size] * 2),
        _args(8, "float", "group", True, group_size=128), _fp8_block, _from_fp8_block),
    "w4a16-int4": CtLayout("pack-quantized", _int4_weights, None, _int4_packed, _from_int4_packed),
    "w4a8-int": CtLayout("int-quantized", _int4_weights, INT8_TOKEN, _int4_unpacked,
                         _from_int4_unpacked),
    "w4a16-nvfp4": CtLayout("nvfp4-pack-quantized",
                            lambda qw: _args(4, "float", "tensor_group", False, group_size=16),
                            None, _nvfp4, _from_nvfp4),
}
FULL_PRECISION = "none"  # a QWeight of this scheme is written as a plain `weight`


def _layout(scheme: str) -> CtLayout:
    if scheme not in LAYOUTS:
        raise UserError(
            f"no compressed-tensors layout for qarl scheme {scheme!r}; writable: "
            f"{sorted(LAYOUTS)} (use --format hf for full precision)"
        )
    return LAYOUTS[scheme]


# ---- the public verbs -------------------------------------------------------------------------

def ct_layer_tensors(qw: QWeight) -> dict[str, Tensor]:
    """One QWeight -> {leaf name: tensor} in compressed-tensors' names, dtypes and shapes
    (module docstring's table). Raises ValueError for a layout it cannot write faithfully."""
    if qw.scheme == FULL_PRECISION:
        return {"weight": qw.codes}
    return _layout(qw.scheme).to_ct(qw)


def ct_state(state: dict[str, Tensor | QWeight]) -> dict[str, Tensor]:
    """A whole `qarl.quant.export_state(model)` dict -> flat compressed-tensors names
    (`model.layers.0.self_attn.q_proj.weight_scale`); tensors pass as they are, including
    `lm_head.weight` when it is tied to the embedding (vLLM's CPU build reads it)."""
    out: dict[str, Tensor] = {}
    for name, value in state.items():
        if isinstance(value, QWeight):
            module = _module_of(name)
            out.update({f"{module}.{leaf}": t for leaf, t in ct_layer_tensors(value).items()})
        else:
            out[name] = value
    return out


def _module_of(weight_name: str) -> str:
    module, _, leaf = weight_name.rpartition(".")
    if leaf != "weight":
        raise ValueError(f"a QWeight must sit at '<module>.weight', got {weight_name!r}")
    return module


def _group_of(qw: QWeight) -> dict:
    layout = _layout(qw.scheme)
    return {"weights": layout.weights(qw), "input_activations": layout.input_activations,
            "output_activations": None, "format": layout.format}


def quantization_config(state: dict[str, Tensor | QWeight]) -> dict:
    """The `quantization_config` block of config.json for `ct_state(state)`: one config group
    per distinct scheme (targets: the exact module names), every other linear layer (2-D
    `.weight` other than the embedding, lm_head included) in `ignore`."""
    groups: dict[str, dict] = {}  # JSON of the group's args -> group
    ignore = []
    for name, value in state.items():
        if isinstance(value, QWeight) and value.scheme != FULL_PRECISION:
            group = _group_of(value)
            key = json.dumps(group, sort_keys=True)
            groups.setdefault(key, {**group, "targets": []})["targets"].append(_module_of(name))
        elif name.endswith(".weight") and value_ndim(value) == 2 and _EMBEDDING not in name:
            ignore.append(_module_of(name))
    if not groups:
        raise UserError("the state holds no quantized layer: there is nothing to write as "
                         "compressed-tensors; export it with --format hf")
    formats = {g["format"] for g in groups.values()}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())},
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
    }


def value_ndim(value: Tensor | QWeight) -> int:
    return len(value.shape) if isinstance(value, QWeight) else value.dim()


def _scheme_of(group: dict) -> str:
    """The qarl scheme whose layout writes this config group (qarl's own exports)."""
    for scheme, layout in LAYOUTS.items():
        weights = group["weights"]
        probe = QWeight(scheme, (0, 0), torch.empty(0), group_size=weights.get(
            "group_size") or (weights.get("block_structure") or [0])[-1])
        if (layout.format, layout.weights(probe), layout.input_activations) == (
                group.get("format"), weights, group.get("input_activations")):
            return scheme
    raise ValueError(f"config group {group} is not one qarl writes; read_ct reads qarl's own "
                     f"exports ({sorted(LAYOUTS)})")


def read_ct(folder: str | Path) -> dict[str, Tensor | QWeight]:
    """The inverse of writing `ct_state` + `quantization_config` into `folder`: qarl's
    export_state dict back, every code and scale bit for bit."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = load_file(folder / WEIGHTS_FILE)
    state: dict[str, Tensor | QWeight] = {}
    for group in config["config_groups"].values():
        scheme = _scheme_of(group)
        for module in group["targets"]:
            prefix = module + "."
            leaves = {k[len(prefix):]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix)
                      and "." not in k[len(prefix):]}
            state[module + ".weight"] = LAYOUTS[scheme].from_ct(leaves, group["weights"])
    state.update(tensors)
    return state
