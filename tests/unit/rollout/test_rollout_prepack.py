"""Packed, fused decoding (the engine's decode plan): same products up to rounding, never
stale, and `score` on a second model with the same weights bit-identical to `generate`."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qarl.rollout import LocalEngine
from qarl.rollout.fused import linear as fused_linear
from qarl.rollout.plan import DecodePlanner
from qarl.rollout.prepack import prepack_available
from qarl.types import SamplingParams

pytestmark = pytest.mark.skipif(
    not prepack_available(torch.device("cpu")), reason="torch built without oneDNN"
)
PROMPTS = [[5, 17, 3, 99, 42], [7, 8], [1, 2, 3]]
GREEDY = SamplingParams(max_new_tokens=10, greedy=True)
SHORT = SamplingParams(max_new_tokens=4, greedy=True)  # enough to see a changed weight
FAMILIES = ["llama", "qwen2", "qwen3"]  # qwen2: q/k/v biases; qwen3: per-head q/k RMSNorm


def plan_forward(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [B, T, d] and logits [B, T, V] of a cache-free forward through the
    engine's decode plan."""
    with torch.inference_mode():
        plan = DecodePlanner().plan(model, batch_hint=ids.shape[0])
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        hidden = plan.hidden(ids, positions, None, 0, None)
        return hidden.clone(), plan.lm_head(hidden).clone()


def paths_of(engine: LocalEngine, start: str) -> set[str]:
    """Module names whose described path starts with `start`."""
    return {name for name, path in engine.describe().items() if path.startswith(start)}


def fresh_logp(model: nn.Module) -> torch.Tensor:
    """Greedy logprobs of a new engine (no packed weights yet) on a copy of `model`."""
    engine = LocalEngine(copy.deepcopy(model), eos_token_ids=())
    return engine.generate(PROMPTS, SHORT, seed=0).rollout_logp


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_blocks_match_plain_forward(make_model, family):
    """The plan runs every decoder block fused and lm_head packed, and the logits of a ragged,
    cache-free forward equal the model's own forward to fp32 rounding (1e-5 on logits of
    size ~10)."""
    model = make_model(family=family)
    ids = torch.tensor([PROMPTS[0], [7, 8, 1, 2, 3]])
    with torch.no_grad():
        plain = model.logits(ids)
    engine = LocalEngine(model)
    assert paths_of(engine, "fused block") == {"model.layers.0", "model.layers.1"}
    assert paths_of(engine, "packed linear") == {"lm_head"}
    torch.testing.assert_close(plan_forward(model, ids)[1], plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_per_linear_and_unpacked_engines_agree(make_model, family):
    """Greedy tokens are the same with fused blocks, per-linear packing and F.linear
    (prepack_weights=False); logprobs agree within 1e-5."""
    model = make_model(family=family)
    fused = LocalEngine(model, eos_token_ids=()).generate(PROMPTS, GREEDY, seed=0)
    per_linear = LocalEngine(model, eos_token_ids=(), fuse_blocks=False)
    linear = per_linear.generate(PROMPTS, GREEDY, seed=0)
    linears = {name for name, m in model.named_modules() if type(m) is nn.Linear}
    assert paths_of(per_linear, "packed linear") == linears
    unpacked = LocalEngine(model, eos_token_ids=(), prepack_weights=False)
    assert paths_of(unpacked, "own forward") == {*linears, "model.layers.0", "model.layers.1"}
    plain = unpacked.generate(PROMPTS, GREEDY, seed=0)
    for other in (linear, plain):
        assert torch.equal(fused.response_ids, other.response_ids)
        torch.testing.assert_close(fused.rollout_logp, other.rollout_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_score_on_a_twin_model_reproduces_generate_bit_for_bit(make_model, family):
    """The trainer's setup: one engine samples, a second engine around another model object
    with the same weights (each with its own packed copies) scores the batch; the sampler
    logprobs are reproduced exactly, with and without prepacking."""
    model = make_model(family=family)
    twin = copy.deepcopy(model)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.9)
    for prepack in (True, False):
        batch = LocalEngine(model, eos_token_ids=(3,), prepack_weights=prepack).generate(
            PROMPTS, sampling, seed=4
        )
        scorer = LocalEngine(twin, eos_token_ids=(3,), prepack_weights=prepack)
        assert torch.equal(scorer.score(batch, sampling), batch.rollout_logp)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_updating_any_single_parameter_is_never_served_stale(make_model, family):
    """After an in-place update of just one parameter (a k_proj weight inside a fused q/k/v
    pack, a q_proj bias, a q-norm weight, the untied lm_head), the engine generates what a
    fresh engine on the updated model generates."""
    model = make_model(family=family)
    engine = LocalEngine(model, eos_token_ids=())
    before = engine.generate(PROMPTS, SHORT, seed=0)
    names = ["model.layers.1.self_attn.k_proj.weight", "lm_head.weight"]
    names.append(
        "model.layers.0.self_attn.q_proj.bias" if family == "qwen2"
        else "model.layers.0.self_attn.q_norm.weight"
    )
    params = dict(model.named_parameters())
    for name in names:
        with torch.no_grad():
            params[name].mul_(-1.5)
        after = engine.generate(PROMPTS, SHORT, seed=0)
        assert not torch.equal(after.rollout_logp, before.rollout_logp), name
        assert torch.equal(after.rollout_logp, fresh_logp(model)), name
        before = after


def test_optimizer_step_and_replaced_parameters_are_never_served_stale(make_model):
    """An optimizer step (in-place, bumps the version counter) and a parameter replaced by a
    new tensor both reach the next generate."""
    model = make_model()
    engine = LocalEngine(model, eos_token_ids=())
    engine.generate(PROMPTS, SHORT, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model.logits(torch.tensor(PROMPTS[:1])).logsumexp(-1).sum().backward()
    optimizer.step()
    stepped = engine.generate(PROMPTS, SHORT, seed=0)
    assert torch.equal(stepped.rollout_logp, fresh_logp(model))
    up = model.model.layers[0].mlp.up_proj
    up.weight = nn.Parameter(up.weight.detach() * 2)
    replaced = engine.generate(PROMPTS, SHORT, seed=0)
    assert torch.equal(replaced.rollout_logp, fresh_logp(model))


def test_only_plain_fp32_linears_are_packed_and_partly_custom_blocks_are_not_fused(make_model):
    """A block with a non-plain linear (e.g. a quantized layer) or a forward hook runs its own
    forward; its plain linears are packed one by one, the custom one is left alone; bf16
    models are not packed."""

    class Custom(nn.Linear):
        pass

    model = make_model()
    model.model.layers[0].mlp.up_proj.__class__ = Custom
    model.model.layers[1].self_attn.register_forward_hook(lambda *args: None)
    engine = LocalEngine(model)
    assert paths_of(engine, "own forward (Block") == {"model.layers.0", "model.layers.1"}
    assert paths_of(engine, "own forward (Custom") == {"model.layers.0.mlp.up_proj"}
    packed = paths_of(engine, "packed linear")
    assert "model.layers.0.mlp.gate_proj" in packed and "model.layers.1.self_attn.q_proj" in packed
    assert len(packed) == 7 + 7 - 1 + 1  # both blocks' projections but the custom one, lm_head
    model = make_model()
    model.lm_head.__class__ = Custom
    assert LocalEngine(model).describe()["lm_head"] == "own forward (Custom.forward)"
    bf16 = LocalEngine(make_model(dtype=torch.bfloat16))
    assert paths_of(bf16, "packed") == set() and paths_of(bf16, "fused") == set()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", ["w8a8-int8", "w4a16-int4"])
def test_quantized_blocks_fuse_exactly_and_score_exactly(make_model, family, scheme):
    """Kernel-mode quantized blocks run fused (q/k/v and gate/up as one quantized GEMM each on
    row-stacked QWeights) and the plain lm_head packed; the fused forward equals the model's
    own per-layer forward to fp32 rounding, and score on a second engine reproduces generate
    exactly."""
    from qarl.quant import quantize_model

    options = {"group_size": 32} if scheme == "w4a16-int4" else {}
    model = quantize_model(make_model(family=family), scheme, mode="kernel", exclude=["lm_head"],
                           **options)
    ids = torch.tensor([PROMPTS[0], [7, 8, 1, 2, 3]])
    with torch.no_grad():
        plain = model(ids)  # hidden states [B, T, d]
    engine = LocalEngine(model, eos_token_ids=())
    assert paths_of(engine, "fused block") == {"model.layers.0", "model.layers.1"}
    assert paths_of(engine, "packed linear") == {"lm_head"}
    # the quantized GEMMs are row-exact (test_kernels.py); what differs is the summation order
    # of the native RMSNorm and silu (a few ulp); a flipped activation code would cost ~1e-2
    torch.testing.assert_close(plan_forward(model, ids)[0], plain, atol=1e-5, rtol=0)
    sampling = SamplingParams(max_new_tokens=8)
    batch = engine.generate(PROMPTS, sampling, seed=1)
    scored = LocalEngine(model, eos_token_ids=()).score(batch, sampling)
    assert torch.equal(scored, batch.rollout_logp)


def test_fused_quantized_block_follows_pushed_weights(make_model):
    """A push (load_state installs new QWeights) rebuilds the stacked packs: decoding after a
    push equals a fresh engine on the pushed weights, never the stale ones."""
    from qarl.quant import export_state, load_state, quantize_model

    engine_model = quantize_model(make_model(), "w8a8-int8", mode="kernel")
    learner = quantize_model(make_model(), "w8a8-int8", mode="kernel")
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = LocalEngine(engine_model, eos_token_ids=())
    before = engine.generate(PROMPTS, SHORT, seed=0).rollout_logp
    load_state(engine_model, export_state(learner))
    after = engine.generate(PROMPTS, SHORT, seed=0).rollout_logp
    fresh = quantize_model(make_model(), "w8a8-int8", mode="kernel")
    load_state(fresh, export_state(learner))
    reference = LocalEngine(fresh, eos_token_ids=()).generate(PROMPTS, SHORT, seed=0).rollout_logp
    assert not torch.equal(before, after)
    assert torch.equal(after, reference)

@pytest.mark.parametrize("scheme", [None, "w8a8-int8"])
def test_released_packs_are_rebuilt_to_the_same_bits(make_model, scheme):
    """release_caches drops every pack the engine built (the fused blocks' and the lm_head's),
    and the next generate builds them again: the same tokens and logprobs bit for bit as
    without the release."""
    from qarl.quant import quantize_model

    model = make_model() if scheme is None else quantize_model(make_model(), scheme, mode="kernel")
    engine = LocalEngine(model, eos_token_ids=())
    first = engine.generate(PROMPTS, SHORT, seed=3)
    assert engine._planner._packs  # the blocks and the lm_head
    engine.release_caches()
    assert engine._planner._packs == {}
    again = engine.generate(PROMPTS, SHORT, seed=3)
    assert engine._planner._packs
    assert torch.equal(again.response_ids, first.response_ids)
    assert torch.equal(again.rollout_logp, first.rollout_logp)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", [None, "none", "w8a8-int8", "w4a16-int4", "w4a8-int"])
def test_one_call_native_block_equals_the_step_by_step_block(make_model, family, scheme,
                                                             monkeypatch):
    """At each decode step a block whose projections all run qarl.native's GEMMs goes through
    one native call (`qarl.native.DecodeBlock`); it computes exactly what the step-by-step
    fused block computes: sampled tokens and logprobs equal bit for bit, at batch 1, 2 (int4
    from registers) and 3 (int4 through a dequantized panel), with q/k/v biases (qwen2) and
    q/k norms (qwen3)."""
    from qarl import native
    from qarl.quant import quantize_model
    from qarl.rollout import prepack

    if not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    model = make_model(family=family)
    if scheme is not None:
        options = {"group_size": 32} if scheme.startswith("w4") else {}
        quantize_model(model, scheme, mode="kernel", **options)
    sampling = SamplingParams(max_new_tokens=6)
    calls = []
    one_call = LocalEngine(model, eos_token_ids=())
    original = native.DecodeBlock.__call__
    monkeypatch.setattr(native.DecodeBlock, "__call__",
                        lambda self, *args: calls.append(1) or original(self, *args))
    with_block = [one_call.generate(PROMPTS[:n], sampling, seed=n) for n in (1, 2, 3)]
    assert len(calls) == 3 * 5 * 2  # 3 calls x 5 decode steps x 2 blocks
    monkeypatch.setattr(prepack, "_native_block", lambda *args: None)
    steps = LocalEngine(copy.deepcopy(model), eos_token_ids=())
    for n, batch in zip((1, 2, 3), with_block):
        ref = steps.generate(PROMPTS[:n], sampling, seed=n)
        assert torch.equal(batch.response_ids, ref.response_ids)
        assert torch.equal(batch.rollout_logp, ref.rollout_logp)
    assert len(calls) == 30  # the second engine never used it


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", ["w8a8-int8", "w4a16-int4"])
def test_fake_blocks_fuse_on_each_layers_own_gemms(make_model, family, scheme):
    """A fake-mode learner's blocks run fused when it replays: each stacked GEMM's outputs are
    the layers' own fake forwards bit for bit (one activation quantization per shared input,
    F.linear on each layer's dequantized weight), the whole forward equals the model's own to
    fp32 rounding, and score reproduces generate exactly."""
    from qarl.quant import quantize_model

    options = {"group_size": 32} if scheme == "w4a16-int4" else {}
    model = quantize_model(make_model(family=family), scheme, mode="fake", exclude=["lm_head"],
                           **options)
    engine = LocalEngine(model, eos_token_ids=())
    assert paths_of(engine, "fused block in PyTorch ops") == {"model.layers.0", "model.layers.1"}
    assert engine.describe()["model.layers.0"].endswith(
        model.model.layers[0].self_attn.q_proj.kernel_path())
    a, m = model.model.layers[1].self_attn, model.model.layers[1].mlp
    rows = torch.randn(5, 64)
    with torch.inference_mode():
        packs = DecodePlanner().plan(model, batch_hint=5).steps[1].args[1]
        for pack, bias, stack in ((packs.qkv, packs.qkv_bias, [a.q_proj, a.k_proj, a.v_proj]),
                                  (packs.gate_up, packs.gate_up_bias, [m.gate_proj, m.up_proj]),
                                  (packs.o, a.o_proj.bias, [a.o_proj]),
                                  (packs.down, m.down_proj.bias, [m.down_proj])):
            x = rows if stack[0] is not m.down_proj else torch.randn(5, 128)
            assert torch.equal(fused_linear(x, pack, bias), torch.cat([lin(x) for lin in stack], -1))
    ids = torch.tensor([PROMPTS[0], [7, 8, 1, 2, 3]])
    with torch.no_grad():
        plain = model(ids)
    torch.testing.assert_close(plan_forward(model, ids)[0], plain, atol=1e-5, rtol=0)
    sampling = SamplingParams(max_new_tokens=8)
    batch = engine.generate(PROMPTS, sampling, seed=1)
    assert torch.equal(LocalEngine(model, eos_token_ids=()).score(batch, sampling),
                       batch.rollout_logp)


def test_fake_blocks_follow_an_optimizer_step(make_model):
    """A fake learner's packs are keyed on its layers' QWeights: after an optimizer step on the
    master weights the next replay runs the new dequantized weights, as a fresh engine does."""
    from qarl.quant import quantize_model

    model = quantize_model(make_model(), "w8a8-int8", mode="fake", exclude=["lm_head"])
    engine = LocalEngine(model, eos_token_ids=())
    before = engine.generate(PROMPTS, SHORT, seed=0).rollout_logp
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model.logits(torch.tensor(PROMPTS[:1])).logsumexp(-1).sum().backward()
    optimizer.step()
    stepped = engine.generate(PROMPTS, SHORT, seed=0).rollout_logp
    assert not torch.equal(before, stepped)
    assert torch.equal(stepped, fresh_logp(model))
