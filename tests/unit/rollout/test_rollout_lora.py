"""LoRA adapters on the engine's and the learner's layers (qarl/lora/layers.py): B = 0 is the
base model exactly, kernel alignment stays exact with trained adapters in every format (dense
and MoE experts), an adapters-only push reaches the engine, and only adapters train."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qarl
from qarl.quant import SCHEMES, QuantLinear, export_state, load_state, quantize_model, release_masters
from qarl.lora.layers import (
    LoraLinear, LoraQuantLinear, adapter_state, attach_lora, lora_names, merged_weights,
    remove_adapters,
)

SAMPLING = qarl.SamplingParams(max_new_tokens=10, temperature=1.0)
PROMPTS = [[5, 6, 7], [9], [3, 4, 5, 6, 7, 8], [11, 12]]
MOE = dict(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
           norm_topk_prob=True, mlp_only_layers=[1], num_layers=3)


def _quantized(model, scheme: str, mode: str = "kernel"):
    return model if SCHEMES[scheme].is_identity else quantize_model(model, scheme, mode=mode)


def _train_adapters(model, seed: int = 3) -> None:
    """Adapters as after some training: B nonzero (A keeps its init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in adapter_state(model).items():
            if name.endswith("lora_B"):
                t.copy_(0.05 * torch.randn(t.shape, generator=g))


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_zero_b_is_the_base_model(make_model, scheme):
    """Rank-4 adapters at their init (B = 0): the model's logits are the base model's bit for
    bit where the base is quantized (its kernel plus an exact zero), to fp32 rounding where it
    is plain (the adapted layer's no-grad GEMM is qarl.native's packed one, the plain model's
    F.linear: max 1e-6 measured). The engine then draws the same tokens; its logprobs differ
    by rounding only, since the base model's engine fuses whole blocks into one native call
    (residual adds inside the GEMMs) and the adapted model's runs them layer by layer
    (measured max: 0 for w4a16 / block FP8, 1.4e-6 fp32 and int8, 1.2e-5 per-token FP8, whose
    E4M3 activation codes amplify a last-bit difference: tolerance 1e-4)."""
    base = _quantized(make_model(seed=1), scheme)
    adapted = copy.deepcopy(base)
    attach_lora(adapted, rank=4, alpha=8.0)
    ids = torch.tensor([PROMPTS[2], PROMPTS[2][::-1]])
    with torch.no_grad():
        a, b = base.logits(ids), adapted.logits(ids)
    if SCHEMES[scheme].is_identity:
        assert torch.allclose(a, b, rtol=0, atol=1e-5)
    else:
        assert torch.equal(a, b)
    x = qarl.LocalEngine(base, eos_token_ids=(2,)).generate(PROMPTS, SAMPLING, seed=4)
    y = qarl.LocalEngine(adapted, eos_token_ids=(2,)).generate(PROMPTS, SAMPLING, seed=4)
    assert torch.equal(x.response_ids, y.response_ids)
    assert torch.allclose(x.rollout_logp, y.rollout_logp, rtol=0, atol=1e-4)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_kernel_alignment_is_exact_with_adapters(make_model, scheme, moe):
    """A kernel-mode learner with trained adapters on every block projection (MoE experts
    included) pushes codes + adapters into an engine copy that holds codes only; the learner's
    decode-path replay equals the sampler's logprobs bit for bit (max |dlogp| = 0)."""
    shape = MOE if moe else {}
    learner = _quantized(make_model(seed=1, **shape), scheme)
    engine_model = _quantized(make_model(seed=2, **shape), scheme)
    release_masters(engine_model)
    adapted = attach_lora(learner, rank=4, alpha=8.0)
    attach_lora(engine_model, rank=4, alpha=8.0, init="zeros")
    if moe:
        assert any(".mlp.experts." in n for n in adapted)
    _train_adapters(learner)
    load_state(engine_model, export_state(learner))
    batch = qarl.LocalEngine(engine_model, eos_token_ids=(2,)).generate(PROMPTS, SAMPLING, seed=5)
    replay = qarl.LocalEngine(learner, eos_token_ids=(2,)).score(batch, SAMPLING)
    assert float((replay - batch.rollout_logp).abs().max()) == 0.0
    assert torch.equal(replay, batch.rollout_logp)


def test_an_adapters_only_push_reaches_the_engine(make_model):
    """After a whole push, a partial one of the adapters alone changes what the engine samples
    to the learner's policy exactly; the engine's base codes stay the first push's."""
    learner = quantize_model(make_model(seed=1), "w8a8-int8", mode="kernel")
    engine_model = quantize_model(make_model(seed=2), "w8a8-int8", mode="kernel")
    attach_lora(learner, rank=4, alpha=8.0)
    attach_lora(engine_model, rank=4, alpha=8.0, init="zeros")
    engine = qarl.LocalEngine(engine_model, eos_token_ids=(2,))
    engine.load_weights(export_state(learner))
    codes = {n: qw.codes.clone() for n, qw in engine.qweights().items()}
    _train_adapters(learner)
    with pytest.raises(KeyError, match="missing"):
        engine.load_weights(adapter_state(learner))  # a whole-state push must be whole
    engine.load_weights(adapter_state(learner), partial=True)
    batch = engine.generate(PROMPTS, SAMPLING, seed=6)
    assert torch.equal(qarl.LocalEngine(learner, eos_token_ids=(2,)).score(batch, SAMPLING),
                       batch.rollout_logp)
    assert all(torch.equal(codes[n], qw.codes) for n, qw in engine.qweights().items())


@pytest.mark.parametrize("scheme,mode", [("w8a8-int8", "kernel"), ("w4a16-int4", "fake"),
                                         ("none", "kernel")])
def test_only_adapters_get_gradients_and_the_base_stays(make_model, scheme, mode):
    """Every parameter but the adapters is frozen: one backward gives lora_A / lora_B (and
    only them) gradients, B's nonzero from the first step; an optimizer step over the trainable
    parameters leaves every base weight bit for bit."""
    model = _quantized(make_model(seed=1), scheme, mode)
    names = attach_lora(model, rank=4, alpha=8.0)
    assert len(names) == 2 * 7  # 2 blocks x 7 projections
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(trainable) == sorted(lora_names(model))
    ids = torch.tensor([PROMPTS[2]])
    model.logits(ids).logsumexp(-1).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(trainable)
    assert all(float(g.abs().sum()) > 0 for n, g in grads.items() if n.endswith("lora_B"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (n in trainable), n


def test_dropout_acts_in_the_gradient_pass_only(make_model):
    """lora.dropout drops adapter inputs with grad (PEFT's lora_B(lora_A(dropout(x)))), never
    in a no-grad forward (the engine and the replay)."""
    model = make_model(seed=1)
    attach_lora(model, rank=4, alpha=8.0, dropout=0.5)
    _train_adapters(model)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        a, b = model.logits(ids), model.logits(ids)
    assert torch.equal(a, b)
    torch.manual_seed(0)
    c = model.logits(ids)
    torch.manual_seed(1)
    d = model.logits(ids)
    assert not torch.equal(c, d)


def test_merge_gives_the_adapted_model_and_remove_gives_the_base(make_model):
    """merged_weights = W + (alpha / r) B A: a plain model with them computes the adapted
    model's logits (fp32 rounding of the reordered sum); remove_adapters(merge=False) restores
    the plain base layers, their weights untouched."""
    base = make_model(seed=1)
    model = copy.deepcopy(base)
    attach_lora(model, rank=4, alpha=8.0, include=["q_proj", "down_proj"])
    assert {type(m) for m in model.modules()} >= {LoraLinear}
    _train_adapters(model)
    ids = torch.tensor([PROMPTS[2]])
    merged = copy.deepcopy(model)
    merged_state = merged_weights(merged)
    remove_adapters(merged, merge=True)
    assert not any(isinstance(m, LoraLinear) for m in merged.modules())
    for name, weight in merged_state.items():
        assert torch.equal(merged.get_submodule(name.removesuffix(".weight")).weight, weight)
    with torch.no_grad():
        assert torch.allclose(merged.logits(ids), model.logits(ids), rtol=0, atol=1e-5)
    remove_adapters(model, merge=False)
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n.endswith("proj"))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), base.parameters()))


def test_quantized_lora_layers_keep_their_scheme_and_codes(make_model):
    """attach_lora turns a QuantLinear into a LoraQuantLinear in place: the same object (fused
    peers still point at it), scheme, mode, cached codes; a second quantize_model leaves the
    adapters alone."""
    model = quantize_model(make_model(seed=1), "w4a16-nvfp4", mode="kernel")
    q = model.model.layers[0].self_attn.q_proj
    codes, peers = q.qweight(), q.fused_peers
    attach_lora(model, rank=2, alpha=2.0)
    assert type(q) is LoraQuantLinear and q is model.model.layers[0].self_attn.q_proj
    assert q.qweight() is codes and q.fused_peers == peers
    assert all(isinstance(p, LoraQuantLinear) for p in peers)
    quantize_model(model, "w4a16-nvfp4", mode="fake")
    assert type(q) is LoraQuantLinear and q.mode == "fake" and q.rank == 2
    assert not any(isinstance(m, QuantLinear) and n.endswith(("lora_A", "lora_B"))
                   for n, m in model.named_modules())


def test_bad_targets_and_ranks_are_refused_naming_the_fix(make_model):
    model = make_model(seed=1)
    with pytest.raises(ValueError, match="matches no linear layer.*look like"):
        attach_lora(model, rank=4, alpha=8.0, include=["nothing_here"])
    with pytest.raises(ValueError, match="lora.rank = 64 is larger.*at most 32"):
        attach_lora(model, rank=64, alpha=8.0)  # k_proj / v_proj are 64 -> 32 wide
    assert not any(p.requires_grad is False for p in model.parameters())  # nothing changed
