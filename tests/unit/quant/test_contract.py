"""The quantization contract (qarl/quant/contract.py, qarl/train/sync.py): the layer table
finds a layer quantized on one side only or in another format, and the per-sync digests find
a dropped, stale or altered layer in the engine, naming it and the part that differs."""

from __future__ import annotations

import copy

import pytest
import torch

from qarl.config import QuantSection
from qarl.model import CausalLM, ModelConfig
from qarl.quant import QuantLinear, export_state, quant_layers, quantize_model, release_masters
from qarl.quant.contract import ContractBroken, check_table, layer_table
from qarl.quant.digests import digest_mismatches, engine_digests, state_digests
from qarl.rollout import LocalEngine
from qarl.train.sync import WeightSync

CONFIG = ModelConfig(family="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
LAYER = "model.layers.1.mlp.down_proj"


def _pair(scheme: str = "w8a8-int8", align: str = "kernel", engine_exclude=(), **options):
    """(learner, engine) as the trainer builds them: the engine copy quantized in kernel mode
    (codes only when the learner pushes codes), the learner in `align` (plain when naive)."""
    torch.manual_seed(0)
    learner = CausalLM(CONFIG).eval()
    engine_model = copy.deepcopy(learner)
    quantize_model(engine_model, scheme, mode="kernel", exclude=list(engine_exclude), **options)
    if align != "naive":
        release_masters(engine_model)
        quantize_model(learner, scheme, mode=align, **options)
    engine = LocalEngine(engine_model, eos_token_ids=(), pad_token_id=0)
    if not engine_exclude:  # (load_state itself refuses a QWeight for a full-precision layer)
        engine.load_weights(export_state(learner))
    return learner, engine


def _table(learner, engine, scheme="w8a8-int8", align="kernel", exempt=()):
    return layer_table(learner, engine.qweights(), scheme, align, None, None, exempt)


@pytest.mark.parametrize("align", ["kernel", "fake", "naive"])
def test_matching_sides_pass_and_every_linear_is_listed(align):
    """Learner and engine built alike: every row ok, one row per linear layer (the 14 block
    projections quantized, the tied lm_head full precision on both sides)."""
    learner, engine = _pair(align=align)
    rows = _table(learner, engine, align=align)
    check_table(rows)
    assert [r.layer for r in rows][-1] == "lm_head" and len(rows) == 15
    assert all(r.status == "ok" for r in rows)
    assert sum(r.engine.startswith("w8a8-int8 per-channel sym") for r in rows) == 14
    assert rows[-1].engine == rows[-1].learner == "full precision"


@pytest.mark.parametrize("align", ["kernel", "naive"])
def test_a_layer_left_full_precision_on_the_engine_is_named(align):
    """verl's failure: one projection running full precision in the engine while the learner
    quantizes it. The table marks exactly that layer; check_table names it; an exempt pattern
    accepts it."""
    learner, engine = _pair(align=align, engine_exclude=[LAYER])
    rows = _table(learner, engine, align=align)
    assert [r.layer for r in rows if r.status == "mismatch"] == [LAYER]
    with pytest.raises(ContractBroken, match=LAYER.replace(".", r"\.")):
        check_table(rows)
    exempted = _table(learner, engine, align=align, exempt=["layers.1.mlp.down"])
    check_table(exempted)
    assert [r.layer for r in exempted if r.status == "exempt"] == [LAYER]


def test_another_format_on_the_engine_is_a_mismatch():
    """Same scheme, other group size: every quantized layer's row differs (the format string
    names group size, symmetry and shape)."""
    learner, _ = _pair("w4a16-int4", group_size=32)
    _, engine = _pair("w4a16-int4", group_size=64)
    rows = _table(learner, engine, scheme="w4a16-int4")
    bad = [r for r in rows if r.status == "mismatch"]
    assert len(bad) == 14 and "g32" in bad[0].learner and "g64" in bad[0].engine


def test_digests_find_altered_scales_and_stale_codes():
    """After a push the engine's digests equal the learner's; scales altered in the engine name
    the layer and 'scales'; a push the engine skips (stale) names exactly the layers whose
    codes changed since."""
    learner, engine = _pair()
    state = export_state(learner)
    assert digest_mismatches(state_digests(state), engine_digests(engine.model)) == []
    held = quant_layers(engine.model)[LAYER]
    held._qweight.scales = held._qweight.scales * 1.01
    assert digest_mismatches(state_digests(state), engine_digests(engine.model)) == [
        f"{LAYER} (scales)"]
    engine.load_weights(state)  # repaired
    with torch.no_grad():
        weight = learner.get_submodule(LAYER).weight  # new codes and scales for one layer
        weight.add_(0.05 * torch.randn_like(weight))
    wrong = digest_mismatches(state_digests(export_state(learner)), engine_digests(engine.model))
    assert wrong == [f"{LAYER} (codes, scales)"]


def test_hashing_once_reads_each_storage_once_and_again_after_a_write(monkeypatch):
    """Inside `hashing_once` the engine's digests of the very tensors the learner pushed reuse
    the learner's CRCs (each storage read once across both calls), and equal the digests
    computed apart; a tensor written in place between two calls is read again, and its change
    is named; outside it every call reads its tensors."""
    from qarl.quant import digests

    learner, engine = _pair()
    state = export_state(learner)
    apart = (state_digests(state), engine_digests(engine.model))
    reads = []
    real = digests.tensor_crc
    monkeypatch.setattr(digests, "tensor_crc", lambda t: reads.append(t.data_ptr()) or real(t))
    with digests.hashing_once():
        expected = state_digests(state)
        first = len(reads)
        held = engine_digests(engine.model)
    assert (expected, held) == apart and digest_mismatches(expected, held) == []
    # none read twice; the codes the engine holds are the pushed ones, never read again (its
    # own copies of the unquantized tensors are other storages, read once each)
    assert len(set(reads)) == len(reads)
    codes = [v.codes.data_ptr() for v in state.values() if hasattr(v, "codes")]
    assert codes and not set(codes) & set(reads[first:])
    reads.clear()
    state_digests(state)
    assert len(reads) == first  # outside: read again
    layer = quant_layers(engine.model)[LAYER]
    with digests.hashing_once():
        expected = state_digests(state)
        with torch.no_grad():
            layer._qweight.scales.mul_(1.01)  # in place: the same storage, a new version
        held = engine_digests(engine.model)
    assert digest_mismatches(expected, held) == [f"{LAYER} (scales)"]


def test_naive_push_checks_the_full_precision_weights():
    """A naive learner pushes full-precision weights: the engine's copy of them is compared
    (its codes are its own quantization of them)."""
    learner, engine = _pair(align="naive")
    assert digest_mismatches(state_digests(export_state(learner)),
                             engine_digests(engine.model)) == []
    with torch.no_grad():
        engine.model.get_submodule(LAYER).weight.add_(1e-3)
    assert digest_mismatches(state_digests(export_state(learner)),
                             engine_digests(engine.model)) == [f"{LAYER}.weight (values)"]


class _AlteringEngine(LocalEngine):
    """An engine whose weight install changes one layer's scales after the copy (NeMo-RL's
    dropped KV scales on refit, in kind)."""

    def load_weights(self, state):
        super().load_weights(state)
        layer: QuantLinear = quant_layers(self.model)[LAYER]
        layer._qweight = copy.copy(layer._qweight)
        layer._qweight.scales = layer._qweight.scales * 2


def test_weight_sync_stops_at_the_push_that_breaks_the_contract():
    """WeightSync.push checks every push: a clean engine passes (contract/seconds in the
    metrics), an engine that alters what it installs raises ContractBroken naming the layer
    and the part; sync_check = False skips the check."""
    learner, engine = _pair()
    metrics = WeightSync(learner, engine).push()
    assert metrics["contract/seconds"] > 0
    bad = _AlteringEngine(engine.model, eos_token_ids=(), pad_token_id=0)
    with pytest.raises(ContractBroken, match=rf"{LAYER.replace('.', '[.]')} \(scales\)"):
        WeightSync(learner, bad).push()
    assert "contract/seconds" not in WeightSync(learner, bad, check=False).push()


def test_contract_table_uses_the_recipe_quant_section():
    """WeightSync.contract_table reads scheme, align, include / exclude and contract_exempt
    from the recipe's [quant]."""
    learner, engine = _pair(engine_exclude=[LAYER])
    sync = WeightSync(learner, engine)
    quant = QuantSection(scheme="w8a8-int8", align="kernel", contract_exempt=[LAYER])
    assert {r.status for r in sync.contract_table(quant)} == {"ok", "exempt"}
    with pytest.raises(ContractBroken):
        check_table(sync.contract_table(QuantSection()))
