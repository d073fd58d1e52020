"""Per-tensor digests: whether an engine holds exactly what a weight sync sent it.

`state_digests(state)`: per pushed name, a CRC-32 of each part of what a weight sync sends
(a QWeight: codes, scales, zeros, global scale, layout; a tensor: its bytes); engines compute
the same of what they hold (`engine_digests`, behind `Engine.weight_digests`), and
`digest_mismatches` names every layer whose parts differ: a dropped, stale or altered layer
after a sync. Each storage is hashed once (a tied lm_head is the embedding), on torch's
threads (qarl.native's CRC and zlib's release the GIL); an accidental collision has
probability 2^-32 per part.
Within `hashing_once()` a storage is hashed once across calls too: an engine in this process
that holds the very tensors the learner pushed takes the learner's CRCs of the same bytes,
read at the same moment, instead of reading them again (a Ray actor hashes its own copy).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor, nn

from qarl import native
from qarl.native import bytes as native_bytes
from qarl.quant.apply import quant_layers
from qarl.quant.qweight import QWeight

QWEIGHT_PARTS = ("codes", "scales", "zeros", "global_scale", "layout")
CODES_SUFFIX = ":codes"  # an engine layer's codes next to its master weight (see engine_digests)


def tensor_crc(t: Tensor) -> int:
    """CRC-32 of a tensor's bytes (any dtype, any device: copied to the CPU when needed):
    zlib's, folded by qarl.native's carry-less multiplies where those run (the same value)."""
    t = t.detach().reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    if native.available():
        return native_bytes.crc32(t)
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


# {storage view: CRC} while `hashing_once` is open in this process, else None
_known: dict[tuple, int] | None = None


@contextlib.contextmanager
def hashing_once() -> Iterator[None]:
    """Hash each storage view at most once across the digest calls inside (module docstring).
    A view is its data pointer, shape, strides, dtype, device and version counter, so a
    tensor written in place in between is hashed again."""
    global _known
    outer, _known = _known, {} if _known is None else _known
    try:
        yield
    finally:
        _known = outer


def _crcs(tensors: list[Tensor | None]) -> list[int]:
    """tensor_crc of each (0 for None), each storage view once (a tied lm_head is the
    embedding; within `hashing_once`, across calls), on torch's thread count: zlib releases
    the GIL while it hashes."""
    keys = [None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device,
                                    t._version) for t in tensors]
    known = {} if _known is None else _known
    unique = {k: t for k, t in zip(keys, tensors) if k is not None and k not in known}
    if unique:
        # one task per thread, each a share of the tensors of about equal bytes (largest
        # first onto the lightest share): a state has hundreds of small tensors, and a task
        # per tensor would cost more than hashing it
        shares: list[list[tuple]] = [[] for _ in range(max(1, torch.get_num_threads()))]
        loads = [0] * len(shares)
        for key, t in sorted(unique.items(), key=lambda kt: -kt[1].nbytes):
            lightest = loads.index(min(loads))
            shares[lightest].append((key, t))
            loads[lightest] += t.nbytes
        shares = [share for share in shares if share]
        with ThreadPoolExecutor(len(shares)) as pool:
            for done in pool.map(lambda share: [(k, tensor_crc(t)) for k, t in share], shares):
                known.update(done)
    return [0 if k is None else known[k] for k in keys]


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
