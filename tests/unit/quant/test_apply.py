"""quantize_model / export_state / load_state / describe on a random CausalLM."""

from __future__ import annotations

import pytest
import torch

from qarl import native

from qarl.model import CausalLM, ModelConfig
from qarl.quant import (
    SCHEMES, QuantLinear, QWeight, describe, export_state, load_state, quant_layers,
    quantize_model, release_masters,
)

CONFIG = ModelConfig(family="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)

def _model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(CONFIG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model

def test_default_selection_is_block_projections():
    """Default: every q/k/v/o/gate/up/down projection becomes a QuantLinear; lm_head and the
    embedding stay full precision; lm_head is opt-in and keeps its tie to the embedding."""
    model = quantize_model(_model(), "w8a8-int8")
    names = sorted(quant_layers(model))
    assert len(names) == 2 * 7 and all(n.startswith("model.layers.") for n in names)
    assert type(model.lm_head) is torch.nn.Linear
    quantize_model(model, "w8a8-int8", include=["lm_head"])
    assert isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight

@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_export_load_round_trip_gives_identical_logits(name):
    """An engine copy with other weights, after load_state(export_state(learner)), holds the
    learner's exact codes (no re-quantization) and computes identical logits; the tied,
    quantized lm_head keeps its installed QWeight although the embedding was copied too."""
    options = {"group_size": 32} if name in ("w4a16-int4", "w4a8-int") else {}
    learner = quantize_model(_model(0), name, include=["model.layers.*", "lm_head"], **options)
    engine = quantize_model(_model(1), name, include=["model.layers.*", "lm_head"], **options)
    state = export_state(learner)
    assert isinstance(state["lm_head.weight"], QWeight)
    assert isinstance(state["model.norm.weight"], torch.Tensor)
    load_state(engine, state)
    assert all(layer.quantize_count == 0 for layer in quant_layers(engine).values())
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(learner.logits(ids), engine.logits(ids))
    for key, qw in state.items():
        if isinstance(qw, QWeight):
            owner = key.rsplit(".", 1)[0]
            assert engine.get_submodule(owner).qweight() is not None
            assert engine.get_submodule(owner).quantize_count == 0

def test_export_is_cached_per_weight_version():
    """export_state twice returns the same QWeight objects; after a step, new ones (once)."""
    model = quantize_model(_model(), "w4a16-int4")
    a, b = export_state(model), export_state(model)
    key = "model.layers.0.mlp.up_proj.weight"
    assert a[key] is b[key]
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.01)
    c = export_state(model)
    assert c[key] is not a[key] and model.model.layers[0].mlp.up_proj.quantize_count == 2

def test_load_state_errors():
    """Unknown names, missing names, shape mismatches and QWeights for non-quantized layers
    raise with the offending name."""
    learner = quantize_model(_model(), "w8a8-int8")
    engine = quantize_model(_model(1), "w8a8-int8")
    state = export_state(learner)
    with pytest.raises(KeyError, match="bogus"):
        load_state(engine, {**state, "bogus.weight": torch.zeros(1)})
    partial = dict(state)
    partial.pop("model.norm.weight")
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_state(engine, partial)
    load_state(engine, partial, strict=False)
    with pytest.raises(ValueError, match="shape"):
        load_state(engine, {**state, "model.norm.weight": torch.zeros(3)})
    plain = _model(2)
    with pytest.raises(TypeError, match="QuantLinear"):
        load_state(plain, state)

@pytest.mark.parametrize("name", ["w8a8-int8", "w4a16-int4", "w4a16-nvfp4"])
def test_released_engine_decodes_and_takes_pushes_with_identical_logits(name):
    """release_masters frees every untied quantized weight (the tied lm_head keeps the
    embedding's), leaves state_dict names and shapes as they were, and the copy computes the
    same logits before and after; pushes of QWeights install as before (identical logits to
    the learner's), a full-precision push into a released layer and a re-quantization are
    refused by name. NVFP4 shares one scale across a fused group: the layers keep theirs."""
    options = {"group_size": 32} if name == "w4a16-int4" else {}
    include = ["model.layers.*", "lm_head"]
    learner = quantize_model(_model(0), name, include=include, **options)
    engine = quantize_model(_model(1), name, include=include, **options)
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = engine.logits(ids)
    names = set(engine.state_dict())
    freed = release_masters(engine)
    layers = quant_layers(engine)
    untied = [layer for n, layer in layers.items() if n != "lm_head"]
    assert freed == sum(layer.weight.numel() * 4 for layer in untied)
    assert all(layer.released and layer.weight.untyped_storage().nbytes() == 4
               for layer in untied)
    assert not layers["lm_head"].released
    assert layers["lm_head"].weight is engine.model.embed_tokens.weight
    assert set(engine.state_dict()) == names
    with torch.no_grad():
        assert torch.equal(engine.logits(ids), before)
        with torch.no_grad():
            learner.model.layers[0].mlp.up_proj.weight.add_(0.05)  # a step's change
        load_state(engine, export_state(learner))
        assert torch.equal(engine.logits(ids), learner.logits(ids))
    assert all(layer.quantize_count == 1 for layer in untied)  # only the release's own
    plain = {k: v.detach() for k, v in _model(2).state_dict().items()}
    with pytest.raises(TypeError, match="released its master weight"):
        load_state(engine, plain)
    with pytest.raises(RuntimeError, match="released its master weight"):
        untied[0].forget()

def test_plain_strings_match_as_substrings():
    """include/exclude strings without wildcards match names containing them (recipe docs)."""
    model = quantize_model(_model(), "w8a8-int8", include=["q_proj", "lm_head"], exclude=["layers.1"])
    assert sorted(quant_layers(model)) == ["lm_head", "model.layers.0.self_attn.q_proj"]


def test_quantize_model_errors():
    """Unknown scheme, mode, or a selection that matches nothing raises clearly."""
    with pytest.raises(KeyError, match="valid"):
        quantize_model(_model(), "int2")
    with pytest.raises(ValueError, match="mode"):
        quantize_model(_model(), "w8a8-int8", mode="turbo")
    with pytest.raises(ValueError, match="matched no"):
        quantize_model(_model(), "w8a8-int8", include=["decoder.*"])

def test_describe_names_each_path():
    """describe() lists every quantized layer with scheme, mode and the kernel path chosen."""
    model = quantize_model(_model(), "w4a16-int4", mode="kernel", group_size=32, gemm="int4pack")
    info = describe(model)
    assert len(info) == 14
    assert "int4pack" in info["model.layers.0.mlp.down_proj"]
    assert info["model.layers.0.mlp.down_proj"].startswith("w4a16-int4/kernel")
    auto = describe(quantize_model(_model(), "w4a16-int4", mode="kernel", group_size=32))
    expected = "native int4" if native.available() else "int4pack"
    assert expected in auto["model.layers.0.mlp.down_proj"]

def test_training_step_through_quantized_model():
    """A kernel-mode model trains: loss backward reaches every master weight, and one
    optimizer step re-quantizes each layer exactly once."""
    model = quantize_model(_model(), "w8a8-int8")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = model.logits(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 96), ids[:, 1:].reshape(-1)).backward()
    layers = quant_layers(model)
    assert all(layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0 for layer in layers.values())
    opt.step()
    with torch.no_grad():
        model.logits(ids)
    assert all(layer.quantize_count == 2 for layer in layers.values())


@pytest.mark.parametrize("name", ["w8a8-int8", "w4a16-int4"])
def test_a_bf16_gradient_pass_quantizes_a_fused_groups_input_once(name, monkeypatch):
    """In a bf16 gradient pass the layers of a fused group (q/k/v, gate/up) take one x_hat of
    the input they share: act_qdq_to runs 4 times per block, not 7 (q/k/v, o, gate/up, down),
    and every gradient is that of each layer quantizing its input itself, to the bit."""
    scheme = type(SCHEMES[name])
    act_qdq_to, calls = scheme.act_qdq_to, []
    monkeypatch.setattr(scheme, "act_qdq_to",
                        lambda self, x, dtype: calls.append(1) or act_qdq_to(self, x, dtype))
    ids = torch.randint(0, CONFIG.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    grads, counts = {}, {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(QuantLinear, "_peers_x_hat", lambda self, x, compute: None)
        model = quantize_model(_model(), name)
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        logits.float().square().mean().backward()
        counts[shared] = len(calls)
        grads[shared] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert counts == {True: 4 * CONFIG.num_layers, False: 7 * CONFIG.num_layers}
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 14
    for n, grad in grads[True].items():
        assert torch.equal(grad, grads[False][n]), n
