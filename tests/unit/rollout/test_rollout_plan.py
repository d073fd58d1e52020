"""The engine's decode plan leaves the model as it was, names what runs, and a layer that is
not fused runs its own forward with its plain fp32 linears on packed weights; LocalEngine
satisfies the Engine protocol."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qarl.quant import QuantLinear, quantize_model
from qarl.rollout import Engine, LocalEngine
from qarl.rollout.plan import DecodePlanner, PackedLinear
from qarl.types import SamplingParams

PROMPTS = [[5, 17, 3, 99, 42], [7, 8], [1, 2, 3]]
SAMPLING = SamplingParams(max_new_tokens=6, temperature=0.8)


def quantized(model: nn.Module, how: str | None) -> nn.Module:
    if how == "int8":
        quantize_model(model, "w8a8-int8", mode="kernel")
    elif how == "int8-mlp-only":
        quantize_model(model, "w8a8-int8", mode="kernel", include=["mlp"])
    elif how == "int8-fake":
        quantize_model(model, "w8a8-int8", mode="fake")
    return model


def snapshot(model: nn.Module) -> dict:
    """Per module: its attribute names, its children (by identity) and its hook counts."""
    return {
        name: (set(m.__dict__), [id(c) for c in m._modules.values()],
               len(m._forward_hooks), len(m._forward_pre_hooks))
        for name, m in model.named_modules()
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("how", [None, "int8", "int8-mlp-only", "int8-fake"])
def test_the_model_is_unchanged_by_an_engine(make_model, family, how):
    """Building an engine, describing it, generating and scoring set no attribute, child or
    hook on any module (no instance `forward` anywhere), and the model's own forward gives
    the same output, bit for bit, before and after."""
    model = quantized(make_model(family=family), how)
    ids = torch.tensor([PROMPTS[0], [7, 8, 1, 2, 3]])
    with torch.no_grad():
        before_out = model.logits(ids)
    before = snapshot(model)
    engine = LocalEngine(model, eos_token_ids=())
    engine.describe()
    batch = engine.generate(PROMPTS, SAMPLING, seed=0)
    engine.score(batch, SAMPLING)
    assert snapshot(model) == before
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model.logits(ids), before_out)


def test_local_engine_satisfies_the_engine_protocol(make_model):
    """LocalEngine has every method of qarl.rollout.Engine (runtime-checkable Protocol)."""
    assert isinstance(LocalEngine(make_model()), Engine)
    assert not isinstance(object(), Engine)


def test_describe_names_the_path_of_every_layer(make_model):
    """describe() says per layer whether it runs a fused block (with its GEMM kernel path) or
    its own forward, and per linear of an unfused layer whether it is packed or which
    scheme kernel path runs it."""
    from qarl import native

    fp32 = LocalEngine(make_model()).describe()
    fused = "fused block, one qarl.native DecodeBlock call" if native.available() else "fused block"
    assert fp32["model.layers.0"].startswith(fused)
    assert fp32["lm_head"].startswith("packed linear: ")

    model = quantized(make_model(), "int8")
    paths = LocalEngine(model).describe()
    assert paths["model.layers.1"].endswith(model.model.layers[1].mlp.up_proj.kernel_path())
    assert paths["lm_head"].startswith("packed linear: ")  # not quantized by default
    model = quantize_model(make_model(), "w8a8-int8", include=["model.layers.*", "lm_head"])
    assert LocalEngine(model).describe()["lm_head"] == f"own forward: {model.lm_head.kernel_path()}"

    model = quantized(make_model(), "int8-mlp-only")
    paths = LocalEngine(model).describe()
    assert paths["model.layers.0"] == "own forward (Block.forward)"
    assert paths["model.layers.0.self_attn.q_proj"].startswith("packed linear: ")
    up = model.model.layers[0].mlp.up_proj
    assert paths["model.layers.0.mlp.up_proj"] == f"own forward: {up.kernel_path()}"

    unpacked = LocalEngine(make_model(), prepack_weights=False).describe()
    assert unpacked["model.layers.0"] == "own forward (Block.forward)"
    assert unpacked["lm_head"] == "own forward (Linear.forward)"


def test_unfused_layer_runs_its_own_forward_with_packed_linears(make_model):
    """A partly quantized block's step is its own Block.forward on a copy whose plain fp32
    linears are PackedLinears (sharing the model's biases) and whose quantized linears are
    the model's own: its output equals the same block with those linears swapped in by hand,
    bit for bit."""
    model = quantized(make_model(family="qwen2"), "int8-mlp-only")
    block = model.model.layers[0]
    by_hand = copy.deepcopy(block)
    with torch.inference_mode():
        plan = DecodePlanner().plan(model, batch_hint=2)
        step = plan.steps[0]
        assert type(step) is type(block) and step is not block
        attn, mlp = step.self_attn, step.mlp
        assert type(attn.q_proj) is PackedLinear and attn.q_proj.bias is block.self_attn.q_proj.bias
        assert mlp is block.mlp and type(mlp.up_proj) is QuantLinear
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(by_hand.self_attn, name, getattr(attn, name))
        x = torch.randn(2, 5, 64)
        positions = torch.arange(5).expand(2, 5)
        cos, sin = model.rope(positions, x.dtype)
        assert torch.equal(step(x, cos, sin, None, None, 0, 0), by_hand(x, cos, sin, None, None, 0, 0))
