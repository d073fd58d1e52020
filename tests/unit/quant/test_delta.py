"""Weight deltas (qarl.quant.delta): each encoding restores the new bits exactly, the smallest
is chosen, and a model kept current by deltas holds what whole pushes would give it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qarl.quant import QWeight, SCHEMES, export_state, load_state, quant_layers, quantize_model
from qarl.quant.delta import (
    PartDelta, apply_delta, apply_part, encode_part, encode_state, encoded_bytes,
)
from qarl.quant.digests import digest_mismatches, engine_digests, state_digests

DTYPES = [torch.int8, torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float32]


def _tensor(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


def _changed(t: torch.Tensor, fraction: float, g: torch.Generator) -> torch.Tensor:
    """`t` with about `fraction` of its elements given other bits."""
    new = t.clone()
    bits = new.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    where = torch.rand(t.numel(), generator=g) < fraction
    bits[where] ^= 1  # flip the lowest bit: a different value of the same dtype
    return new


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction, encoding", [(0.001, "offsets16"), (0.3, "bitmask"),
                                                (0.995, "whole")])
def test_each_encoding_restores_the_new_bits(dtype, fraction, encoding):
    """At a small, a middling and a large changed fraction the smallest encoding is the one
    expected, its bytes are `encoded_bytes`' figure, and applying it to the old tensor gives
    the new one bit for bit (over 200k elements: several 65536-element blocks)."""
    g = torch.Generator().manual_seed(0)
    old = _tensor(dtype, 200_003, g)
    new = _changed(old, fraction, g)
    delta = encode_part(old, new)
    assert delta.encoding == encoding
    assert delta.nbytes() == encoded_bytes(old.numel(), delta.changed, old.element_size())[encoding]
    target = old.clone()
    apply_part(target, delta)
    assert torch.equal(target.view(torch.uint8), new.view(torch.uint8))


def test_an_unchanged_tensor_has_no_delta_and_a_wrong_target_is_refused():
    """Equal bits give None; a delta goes only into a tensor of its size and width."""
    t = torch.arange(10, dtype=torch.int8)
    assert encode_part(t, t.clone()) is None
    delta = encode_part(t, t + 1)
    with pytest.raises(ValueError, match="another layout"):
        apply_part(torch.zeros(11, dtype=torch.int8), delta)
    with pytest.raises(ValueError, match="another layout"):
        apply_part(torch.zeros(10, dtype=torch.int16), delta)


def test_offsets_cross_block_edges():
    """Changes on both sides of every 65536 boundary land where they belong."""
    old = torch.zeros(3 * 65536 + 5, dtype=torch.uint8)
    new = old.clone()
    edges = torch.tensor([0, 65535, 65536, 131071, 131072, 3 * 65536 + 4])
    new[edges] = 7
    delta = encode_part(old, new)
    assert delta.encoding == "offsets16" and delta.changed == len(edges)
    apply_part(old, delta)
    assert torch.equal(old, new)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 128)
        self.layers = nn.ModuleList(nn.Linear(128, 256, bias=i == 0) for i in range(3))


def _pair(scheme: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    learner = _Tiny()
    engine = copy.deepcopy(learner)
    quantize_model(learner, scheme, mode="kernel", include=["layers"])
    quantize_model(engine, scheme, mode="kernel", include=["layers"])
    return learner, engine


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if not SCHEMES[s].is_identity])
def test_twenty_deltas_hold_what_whole_pushes_hold(scheme):
    """A model kept current by 20 deltas (each after a random update of a random size to the
    learner's weights) holds the codes, scales and tensors a whole push of the same version
    gives: torch.equal on every part and equal digests, after every delta."""
    learner, engine = _pair(scheme)
    whole = copy.deepcopy(engine)
    load_state(engine, export_state(learner))
    held = {k: v for k, v in export_state(learner).items() if isinstance(v, QWeight)}
    g = torch.Generator().manual_seed(1)
    for version in range(1, 21):
        with torch.no_grad():
            for p in learner.parameters():
                size = 10 ** -float(torch.randint(1, 5, (), generator=g))
                p.add_(size * torch.randn(p.shape, generator=g))
        state = export_state(learner)
        delta = encode_state(held, state, version - 1, version)
        apply_delta(engine, delta)
        load_state(whole, state)
        assert engine_digests(engine) == engine_digests(whole)
        assert digest_mismatches(state_digests(state), engine_digests(engine)) == []
        for name, layer in quant_layers(whole).items():
            mine, want = quant_layers(engine)[name].qweight(), layer.qweight()
            for part in ("codes", "scales", "zeros", "global_scale"):
                a, b = getattr(mine, part), getattr(want, part)
                assert (a is None) == (b is None)
                assert a is None or torch.equal(_raw(a), _raw(b)), part
        held = {k: v for k, v in state.items() if isinstance(v, QWeight)}


def test_another_layout_asks_for_a_whole_push():
    """A QWeight whose group size changed, or a layer the held state lacks, has no delta."""
    learner, _ = _pair("w4a16-int4")
    held = {k: v for k, v in export_state(learner).items() if isinstance(v, QWeight)}
    quantize_model(learner, "w4a16-int4", mode="kernel", include=["layers"], group_size=32)
    assert encode_state(held, export_state(learner), 0, 1) is None
    held.pop("layers.0.weight")
    assert encode_state(held, export_state(_pair("w4a16-int4")[0]), 0, 1) is None


def test_a_delta_is_rebuilt_into_new_qweight_objects():
    """The engine's layers get new QWeight objects (packs and prepared operands are keyed by
    them), whose tensors are the held ones patched in place (no copy of the codes)."""
    learner, engine = _pair("w8a8-int8")
    load_state(engine, export_state(learner))
    before = {n: l.qweight() for n, l in quant_layers(engine).items()}
    held = {k: v for k, v in export_state(learner).items() if isinstance(v, QWeight)}
    with torch.no_grad():
        learner.layers[0].weight.mul_(1.5)
    apply_delta(engine, encode_state(held, export_state(learner), 0, 1))
    after = {n: l.qweight() for n, l in quant_layers(engine).items()}
    assert all(after[n] is not before[n] for n in after)
    assert after["layers.0"].codes.data_ptr() == before["layers.0"].codes.data_ptr()
    assert isinstance(encode_part(torch.zeros(3), torch.ones(3)), PartDelta)


def test_a_delta_survives_pickling():
    """Every encoding pickles and loads back (Ray's object store pickles what it moves) and
    applies to the same bits."""
    import pickle

    g = torch.Generator().manual_seed(2)
    old = _tensor(torch.uint8, 300_000, g)
    for fraction in (0.001, 0.3, 0.995):
        new = _changed(old, fraction, g)
        delta = pickle.loads(pickle.dumps(encode_part(old, new)))
        target = old.clone()
        apply_part(target, delta)
        assert torch.equal(target, new)
