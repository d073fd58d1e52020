"""Training a MoE policy: routing replay, its diagnostic, its recipe check, checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

import qarl
from qarl.algo.diagnostics import routing_disagreement
from qarl.config import ConfigError, load_config
from qarl.model import load_model, moe
from qarl.quant import QWeight, export_state, quantize_model
from qarl.train import checkpoint
from qarl.train.learner.logprobs import response_logprobs

SAMPLING = qarl.SamplingParams(max_new_tokens=8, temperature=1.0)


@pytest.fixture(scope="module")
def naive_pair(tiny_moe_dir):
    """(full-precision learner, int4 engine) of tiny-moe and a batch the engine sampled."""
    learner = load_model(tiny_moe_dir)
    engine_model = quantize_model(load_model(tiny_moe_dir), "w4a16-int4", mode="kernel")
    tok = qarl.load_tokenizer(tiny_moe_dir)
    prompts = [tok.encode(f"What is {a} + {b}?") for a, b in [(1, 2), (30, 4), (7, 75), (9, 9)]]
    batch = qarl.LocalEngine(engine_model, eos_token_ids=()).generate(prompts, SAMPLING, seed=0)
    return learner, batch


def test_routing_replay_makes_the_learner_use_the_engines_experts(naive_pair, monkeypatch):
    """A full-precision learner next to an int4 engine routes some tokens to other experts; with
    routing replay its gradient forward runs exactly the engine's experts at every recorded
    token, and its decode-path replay too (the experts it chooses itself are still reported)."""
    learner, batch = naive_pair
    own_logp, own = qarl.LocalEngine(learner, eos_token_ids=()).score_routing(batch, SAMPLING)
    P = batch.prompt_ids.shape[1]
    before = routing_disagreement(own[:, P:], batch.routed_experts[:, P:], batch.response_mask)
    assert before["routing_disagree_frac"] > 0  # the test is not vacuous

    used = []
    dispatch = moe.dispatch

    def recording_dispatch(x, experts, weights, expert_fns):
        used.append(experts)
        return dispatch(x, experts, weights, expert_fns)

    monkeypatch.setattr(moe, "dispatch", recording_dispatch)
    response_logprobs(learner, batch, SAMPLING.temperature, routing_replay=True)
    N, S = batch.routed_experts.shape[:2]
    used_table = torch.stack([e.view(N, S, -1) for e in used], dim=2)  # [N, S, layers, k]
    recorded = (batch.routed_experts >= 0).all(-1).all(-1)  # [N, S]
    assert torch.equal(used_table[recorded], batch.routed_experts[recorded].long())

    used.clear()
    replay_logp, chosen = qarl.LocalEngine(learner, eos_token_ids=()).score_routing(
        batch, SAMPLING, replay=True)
    assert torch.equal(chosen[:, :, 0], own[:, :, 0])  # the first MoE layer precedes any replay
    assert not torch.equal(replay_logp, own_logp)


def test_replayed_routing_keeps_the_router_gradient(naive_pair):
    """Under routing replay the engine's experts are weighted by the learner's router
    probabilities, so every router gets a nonzero gradient."""
    learner, batch = naive_pair
    logp, _ = response_logprobs(learner, batch, SAMPLING.temperature, routing_replay=True)
    logp.sum().backward()
    grads = [block.mlp.gate.weight.grad for block in learner.model.layers]
    learner.zero_grad(set_to_none=True)
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads)


def test_routing_disagreement_counts_sets_over_recorded_tokens():
    """The same experts in another order agree; one token of two differing in one of two layers
    is 1/4 on average and 1/2 in the worst layer; -1 and masked tokens do not count."""
    engine = torch.tensor([[[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[-1, -1], [-1, -1]]]])
    learner = torch.tensor([[[[1, 0], [2, 3]], [[1, 2], [0, 2]], [[3, 2], [1, 0]]]])
    mask = torch.tensor([[True, True, True]])
    assert routing_disagreement(learner, engine, mask) == {
        "routing_disagree_frac": 0.25, "routing_disagree_max": 0.5}
    nothing = routing_disagreement(learner, engine, torch.zeros(1, 3, dtype=torch.bool))
    assert math.isnan(nothing["routing_disagree_frac"])


def test_routing_replay_needs_a_moe_model():
    """quant.routing_replay on a dense model is refused, naming the model; on tiny-moe
    (qwen3_moe) and smollm2-135m-moe (mixtral) it loads."""
    with pytest.raises(ConfigError, match="quant.routing_replay.*dense qwen3"):
        load_config("tiny", {"quant.routing_replay": True})
    assert load_config("tiny", {"quant.routing_replay": True, "model.name": "tiny-moe"})
    assert load_config("tiny", {"quant.routing_replay": True, "model.name": "smollm2-135m-moe"})


def test_quantized_experts_round_trip_through_checkpoints(tiny_moe_dir, tmp_path):
    """A kernel-mode MoE learner's master weights saved in a checkpoint and loaded into a fresh
    model give the same QWeight codes and scales for every expert (and the same routers)."""
    learner = quantize_model(load_model(tiny_moe_dir), "w8a8-int8", mode="kernel")
    with torch.no_grad():
        learner.model.layers[0].mlp.experts[3].up_proj.weight.add_(0.01)
    folder = checkpoint.save(tmp_path, 1, learner, [], {}, checkpoint.capture_rng(), "", keep=1)
    fresh = quantize_model(load_model(tiny_moe_dir), "w8a8-int8", mode="kernel")
    checkpoint.load_weights(folder, fresh)
    saved, loaded = export_state(learner), export_state(fresh)
    assert saved.keys() == loaded.keys()
    for name, value in saved.items():
        if isinstance(value, QWeight):
            a, b = value.tensors(), loaded[name].tensors()
            assert all(torch.equal(a[k], b[k]) for k in a), name
        else:
            assert torch.equal(value, loaded[name]), name
