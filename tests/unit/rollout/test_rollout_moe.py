"""The engine on Qwen3-MoE models: quantized experts in every format, kernel alignment, the
routing it records."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qarl
from qarl.quant import QuantLinear, SCHEMES, export_state, load_state, quant_layers, quantize_model

MOE = dict(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
           norm_topk_prob=True, mlp_only_layers=[1], num_layers=3)
SAMPLING = qarl.SamplingParams(max_new_tokens=10, temperature=1.0)
PROMPTS = [[5, 6, 7], [9], [3, 4, 5, 6, 7, 8], [11, 12]]


@pytest.fixture
def moe_model(make_model):
    """A random 3-layer Qwen3-MoE (layers 0 and 2 MoE) with every weight moved by shift * N(0, 1)."""
    return lambda shift=0.0: _shifted(make_model(**MOE), shift)


def _shifted(model, shift: float):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if not SCHEMES[s].is_identity])
def test_quantized_experts_kernel_alignment_is_exact(moe_model, scheme):
    """Every expert projection is quantized (the router is not, by default); the engine holding
    the learner's exported QWeights samples, and the kernel-mode learner's decode-path replay
    reproduces the sampler's logprobs and the experts it chose bit for bit."""
    learner = quantize_model(moe_model(shift=0.01), scheme, mode="kernel")
    engine_model = quantize_model(moe_model(), scheme, mode="kernel")
    layers = quant_layers(learner)
    assert len([n for n in layers if ".mlp.experts." in n]) == 2 * 4 * 3  # 2 MoE layers
    assert type(learner.model.layers[0].mlp.gate) is nn.Linear
    load_state(engine_model, export_state(learner))
    engine = qarl.LocalEngine(engine_model, eos_token_ids=(2,))
    batch = engine.generate(PROMPTS, SAMPLING, seed=1)
    assert batch.routed_experts.shape == (4, batch.prompt_ids.shape[1] + batch.response_ids.shape[1], 2, 2)
    logp, routing = qarl.LocalEngine(learner, eos_token_ids=(2,)).score_routing(batch, SAMPLING)
    assert torch.equal(logp, batch.rollout_logp)
    assert torch.equal(routing, batch.routed_experts)


def test_router_is_quantized_only_when_named(moe_model):
    """Including `mlp.gate` quantizes the routers too (and alignment stays exact); the default
    include leaves them nn.Linear, and dense layers' gate_proj are unaffected by the name."""
    learner = quantize_model(moe_model(shift=0.01), "w8a8-int8", mode="kernel",
                             include=["model.layers.*", "mlp.gate"])
    assert isinstance(learner.model.layers[0].mlp.gate, QuantLinear)
    assert isinstance(learner.model.layers[1].mlp.gate_proj, QuantLinear)  # the dense layer
    engine_model = quantize_model(moe_model(), "w8a8-int8", mode="kernel",
                                  include=["model.layers.*", "mlp.gate"])
    load_state(engine_model, export_state(learner))
    batch = qarl.LocalEngine(engine_model).generate(PROMPTS, SAMPLING, seed=2)
    assert torch.equal(qarl.LocalEngine(learner).score(batch, SAMPLING), batch.rollout_logp)


def test_routing_table_marks_what_never_counts(moe_model, make_model):
    """routed_experts holds valid expert ids at real prompt tokens and fed response tokens, and
    -1 at prompt padding and at each row's last response token (its output is never used)."""
    model = moe_model()
    batch = qarl.LocalEngine(model, eos_token_ids=()).generate(PROMPTS, SAMPLING, seed=3)
    routed, P = batch.routed_experts, batch.prompt_ids.shape[1]
    recorded = (routed >= 0).all(-1).all(-1)  # [N, P + L]
    assert torch.equal(recorded[:, :P], batch.prompt_mask)
    assert recorded[:, P:-1].all() and not recorded[:, -1].any()
    assert int(routed.max()) < 4
    dense = qarl.LocalEngine(make_model()).generate(PROMPTS, SAMPLING, seed=3)
    assert dense.routed_experts is None


def test_full_sequence_forward_matches_decode_path(moe_model):
    """The learner's full-sequence forward (response_logprobs) on a MoE model agrees with the
    engine's decode path within fp32 summation-order rounding (1e-4 nats)."""
    from qarl.train.learner.logprobs import response_logprobs

    model = moe_model()
    batch = qarl.LocalEngine(model, eos_token_ids=(2,)).generate(PROMPTS, SAMPLING, seed=4)
    with torch.no_grad():
        fast, _ = response_logprobs(model, batch, SAMPLING.temperature)
    torch.testing.assert_close(fast, batch.rollout_logp, atol=1e-4, rtol=0)
