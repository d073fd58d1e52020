"""Delta weight sync (qarl/train/sync.py with qarl.quant.delta): an engine kept current by
deltas holds, after every push, the bits an engine given whole pushes holds, samples the same
tokens, and gets a whole push whenever it holds another version; a LoRA run never sends a
delta of the frozen codes."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from qarl.config import LoraSection, load_config
from qarl.config.errors import ConfigError
from qarl.lora.recipe import adapt_learner, attach_adapters
from qarl.model import CausalLM, ModelConfig
from qarl.quant import export_state, quant_layers, quantize_model, release_masters
from qarl.quant.delta import PARTS
from qarl.quant.digests import engine_digests
from qarl.rollout import LocalEngine
from qarl.train.sync import WeightSync, sync_deltas
from qarl.types import SamplingParams

CONFIG = ModelConfig(family="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)


def _engine(learner: CausalLM, scheme: str, **options) -> LocalEngine:
    """The engine's copy as the trainer builds it for an aligned learner: codes only."""
    model = copy.deepcopy(learner)
    quantize_model(model, scheme, mode="kernel", **options)
    release_masters(model)
    return LocalEngine(model, eos_token_ids=(), pad_token_id=0)


def _raw(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1).view(torch.uint8)


def _same_bits(a: LocalEngine, b: LocalEngine) -> bool:
    layers_a, layers_b = quant_layers(a.model), quant_layers(b.model)
    for name, layer in layers_a.items():
        x, y = layer.qweight(), layers_b[name].qweight()
        for part in PARTS:
            p, q = _raw(getattr(x, part)), _raw(getattr(y, part))
            if (p is None) != (q is None) or (p is not None and not torch.equal(p, q)):
                return False
    return engine_digests(a.model) == engine_digests(b.model)


def _update(learner: CausalLM, g: torch.Generator) -> None:
    """An update of a random size on a random part of each weight (from a few elements moved
    to every element moved), as an optimizer step moves codes from rarely to everywhere."""
    with torch.no_grad():
        for p in learner.parameters():
            if not p.requires_grad:
                continue
            size = 10 ** -float(torch.randint(1, 5, (), generator=g))
            where = torch.rand(p.shape, generator=g) < float(torch.rand((), generator=g))
            p.add_(size * torch.randn(p.shape, generator=g) * where)


def _small_update(learner: CausalLM, g: torch.Generator) -> None:
    """1% of the weights moved a little: every delta far below the bound on deltas."""
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g) * (torch.rand(p.shape) < 0.01))


@pytest.mark.parametrize("scheme, options", [("w8a8-int8", {}),
                                             ("w4a16-int4", {"group_size": 32}),
                                             ("w4a16-nvfp4", {})])
def test_twenty_delta_pushes_equal_twenty_whole_pushes(scheme, options):
    """20 updates, each pushed as a delta to one engine and whole to another: after every push
    both hold the same codes, scales and tensors bit for bit (and the delta sync's own digest
    check passed); at the end both sample the same tokens with the same logprobs. Deltas
    were sent, smaller than the whole state, and flagged."""
    torch.manual_seed(0)
    learner = quantize_model(CausalLM(CONFIG).eval(), scheme, mode="kernel", **options)
    by_delta, whole = _engine(learner, scheme, **options), _engine(learner, scheme, **options)
    delta_sync = WeightSync(learner, by_delta, delta=True)
    whole_sync = WeightSync(learner, whole)
    g = torch.Generator().manual_seed(1)
    flags = []
    for push in range(21):
        if push:
            _update(learner, g)
        metrics = delta_sync.push()
        whole_sync.push()
        assert _same_bits(by_delta, whole), push
        flags.append(metrics["sync/delta"])
        if metrics["sync/delta"]:
            assert metrics["sync/megabytes"] < metrics["sync/full_megabytes"]
    assert flags[0] == 0 and sum(flags) >= 10
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    a, b = by_delta.generate(prompts, sampling, seed=3), whole.generate(prompts, sampling, seed=3)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logp, b.rollout_logp)


class _RemoteLike(LocalEngine):
    """An engine that receives copies of what it is pushed, as a Ray actor does."""

    def load_weights(self, state, partial=False):
        super().load_weights(copy.deepcopy(state), partial)


def test_engines_patch_their_own_codes_never_the_learners():
    """An in-process engine fed deltas holds its own copy of the codes from its first push on
    (no storage shared with the learner's QWeights), so its in-place patches never reach the
    base of another sync from the same learner: a second engine that gets copies (as a Ray
    actor) stays exact, its digest check passing at each of 5 pushes."""
    torch.manual_seed(0)
    learner = quantize_model(CausalLM(CONFIG).eval(), "w8a8-int8", mode="kernel")
    local = _engine(learner, "w8a8-int8")
    remote = _RemoteLike(copy.deepcopy(local.model), eos_token_ids=(), pad_token_id=0)
    syncs = [WeightSync(learner, e, delta=True) for e in (local, remote)]
    g = torch.Generator().manual_seed(3)
    for push in range(5):
        if push:
            _small_update(learner, g)
        assert [s.push()["sync/delta"] for s in syncs] == [float(push > 0)] * 2
        learners = {layer.qweight().codes.data_ptr() for layer in quant_layers(learner).values()}
        assert not learners & {layer.qweight().codes.data_ptr()
                               for layer in quant_layers(local.model).values()}


def test_an_engine_holding_another_version_gets_a_whole_push():
    """A push that reached the engine another way (no version label), or none at all, makes the
    next push whole; the pushes after it are deltas again."""
    torch.manual_seed(0)
    learner = quantize_model(CausalLM(CONFIG).eval(), "w8a8-int8", mode="kernel")
    engine = _engine(learner, "w8a8-int8")
    sync = WeightSync(learner, engine, delta=True)
    g = torch.Generator().manual_seed(2)
    flags = []
    for push in range(5):
        _small_update(learner, g)
        if push == 2:
            engine.load_weights(export_state(learner))
        flags.append(sync.push()["sync/delta"])
    assert flags == [0, 1, 0, 1, 1]


def test_a_lora_run_pushes_adapters_never_deltas_of_the_codes():
    """With adapters the sync sends the whole state once, then the adapters alone, even when
    asked for deltas; the engine's codes stay the very objects of the first push."""
    torch.manual_seed(0)
    learner = quantize_model(CausalLM(CONFIG).eval(), "w8a8-int8", mode="kernel")
    lora = LoraSection(rank=2)
    engine = _engine(learner, "w8a8-int8")
    attach_adapters(engine.model, lora, init="zeros")
    adapters = adapt_learner(learner, lora)
    sync = WeightSync(learner, engine, adapters=adapters, delta=True)
    assert not sync.delta
    sync.push()
    codes = {n: layer.qweight() for n, layer in quant_layers(engine.model).items()}
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.05)
    metrics = sync.push()
    assert metrics["sync/delta"] == 0 and metrics["sync/changed_code_frac"] == 0
    state = export_state(learner)
    sent = sum(state[n].numel() * state[n].element_size() for n in adapters)
    assert metrics["sync/megabytes"] == sent / 2**20 < metrics["sync/full_megabytes"] / 5
    assert all(layer.qweight() is codes[n] for n, layer in quant_layers(engine.model).items())


class _Engine:
    """An engine whose delta loader says whether a push to it crosses machines."""

    def __init__(self, crosses: bool):
        self.loader = SimpleNamespace(crosses_machines=crosses)

    def delta_loader(self):
        return self.loader


@pytest.mark.parametrize("overrides, crosses, on", [
    ({}, False, False),  # auto: the engine in this process, or Ray workers on this machine
    ({}, True, True),  # auto: Ray workers on other machines
    ({"quant.sync_delta": True}, False, True),
    ({"quant.sync_delta": False}, True, False),
    ({"quant.align": "naive"}, True, False),
    ({"quant.scheme": "none"}, True, False),
    ({"lora.rank": 4}, True, False),
])
def test_sync_delta_resolves_where_deltas_apply(overrides, crosses, on):
    """'auto' sends deltas where a push crosses machines; never with full-precision pushes or
    LoRA."""
    assert sync_deltas(load_config("tiny", overrides), _Engine(crosses)) is on


@pytest.mark.parametrize("overrides, why", [
    ({"quant.align": "naive"}, "pushes full-precision weights"),
    ({"quant.scheme": "none"}, "has no codes"),
    ({"lora.rank": 4}, "adapters alone"),
])
def test_sync_delta_true_where_it_cannot_apply_is_refused(overrides, why):
    """quant.sync_delta = true is refused, with the reason, where no delta can be sent."""
    with pytest.raises(ConfigError, match=f"quant.sync_delta.*{why}"):
        load_config("tiny", {"quant.sync_delta": True, **overrides})


def test_a_delta_for_another_version_is_refused_and_one_already_there_is_a_no_op():
    """EngineDeltas.load_delta takes a delta only on the version it was encoded from: another
    version raises StaleWeights and changes nothing; the delta's own version takes nothing."""
    from qarl.quant.delta import encode_state
    from qarl.rollout.protocol import StaleWeights

    torch.manual_seed(0)
    learner = quantize_model(CausalLM(CONFIG).eval(), "w8a8-int8", mode="kernel")
    engine = _engine(learner, "w8a8-int8")
    loader = engine.delta_loader()
    state = export_state(learner)
    loader.load_versioned(state, 1)
    held = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    _small_update(learner, torch.Generator().manual_seed(4))
    delta = encode_state(held, export_state(learner), 1, 2)
    before = engine_digests(engine.model)
    with pytest.raises(StaleWeights, match="from version 1 to 2 .* holds version 7"):
        engine.weight_version = 7
        loader.load_delta(delta)
    assert engine_digests(engine.model) == before and loader.versions() == [7]
    engine.weight_version = 2
    loader.load_delta(delta)
    assert engine_digests(engine.model) == before
