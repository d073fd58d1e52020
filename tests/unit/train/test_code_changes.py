"""The per-step code-change metric of the weight sync (qarl/train/sync.py `code_changes`):
the fraction of codes that changed, over every layer and per kind of layer, counted from the
codes or taken from a delta's per-layer counts, which must agree."""

from __future__ import annotations

import pytest
import torch

from qarl.quant import SCHEMES, QWeight
from qarl.quant.delta import encode_state
from qarl.train.sync import code_changes, layer_kind

NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
         "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.experts.3.down_proj"]


def _state(scheme: str, g: torch.Generator) -> dict[str, QWeight]:
    return {name: SCHEMES[scheme].quantize(torch.randn(32, 64, generator=g) * 0.05)
            for name in NAMES}


def _moved(state: dict[str, QWeight], counts: dict[str, int]) -> dict[str, QWeight]:
    """A copy of `state` with the first `counts[name]` code bytes of each layer changed."""
    out = {}
    for name, qw in state.items():
        codes = qw.codes.clone()
        flat = codes.view(torch.uint8).reshape(-1)
        flat[: counts[name]] += 1  # every byte a different value (uint8 wraps)
        out[name] = QWeight(qw.scheme, qw.shape, codes, qw.scales, qw.zeros, qw.global_scale,
                            group_size=qw.group_size, symmetric=qw.symmetric)
    return out


def test_layer_kind_is_the_module_names_last_part():
    """Dense projections and a MoE's experts of the same projection share a kind; the head
    is its own."""
    assert [layer_kind(n) for n in NAMES] == ["q_proj", "down_proj", "q_proj", "down_proj"]
    assert layer_kind("lm_head") == "lm_head"
    assert layer_kind("model.layers.2.mlp.gate") == "gate"


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w4a16-int4"])
def test_changed_fraction_per_kind_counts_each_kinds_codes(scheme):
    """Per kind: changed code bytes / code bytes of that kind's layers; overall: all changed
    / all bytes (packed int4: a byte, two codes, counts once)."""
    old = _state(scheme, torch.Generator().manual_seed(0))
    per_layer = old[NAMES[0]].codes.numel()
    counts = dict(zip(NAMES, [10, 3, 30, 0]))
    metrics = code_changes(old, _moved(old, counts))
    assert metrics["sync/changed_code_frac/q_proj"] == 40 / (2 * per_layer)
    assert metrics["sync/changed_code_frac/down_proj"] == 3 / (2 * per_layer)
    assert metrics["sync/changed_code_frac"] == 43 / (4 * per_layer)
    assert metrics["sync/scale_rel_drift"] == 0.0  # the scales were not touched


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w4a16-int4", "w4a16-nvfp4"])
def test_a_deltas_counts_give_the_same_metrics_as_counting(scheme):
    """The sync with deltas takes each layer's changed codes from the delta's encoding
    instead of comparing the codes again: the metrics must be the same."""
    g = torch.Generator().manual_seed(1)
    old = _state(scheme, g)
    new = {name: SCHEMES[scheme].quantize(SCHEMES[scheme].dequantize(qw)
                                          + torch.randn(qw.shape, generator=g) * 1e-3)
           for name, qw in old.items()}
    delta = encode_state({f"{k}.weight": v for k, v in old.items()},
                         {f"{k}.weight": v for k, v in new.items()}, 0, 1)
    counts = {k.removesuffix(".weight"): d.parts["codes"].changed
              for k, d in delta.qweights.items() if "codes" in d.parts}
    counted = code_changes(old, new)
    assert 0 < counted["sync/changed_code_frac"] < 1
    assert code_changes(old, new, counts) == counted


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w4a16-int4"])
def test_counting_in_place_and_by_torch_give_the_same_metrics(scheme, monkeypatch):
    """qarl.native compares the codes in place where it runs; without it, torch counts the
    nonzero bytes of their difference: the same metrics, scale drift included."""
    from qarl.train import sync

    g = torch.Generator().manual_seed(2)
    old = _state(scheme, g)
    new = {name: SCHEMES[scheme].quantize(SCHEMES[scheme].dequantize(qw) * 1.01
                                          + torch.randn(qw.shape, generator=g) * 1e-3)
           for name, qw in old.items()}
    native = code_changes(old, new)
    monkeypatch.setattr(sync.native, "available", lambda: False)
    portable = code_changes(old, new)
    assert native == portable
    assert 0 < native["sync/changed_code_frac"] < 1 and native["sync/scale_rel_drift"] > 0
