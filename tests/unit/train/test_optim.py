"""qarl.train.learner.optim: which parameters each optimizer trains, and the learning-rate schedule."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from qarl.model import CausalLM
from qarl.model.config import ModelConfig
from qarl.quant import QuantLinear, quantize_model
from qarl.train.learner.optim import build_optimizer, learning_rate, muon_parameter_names, set_learning_rate


@pytest.fixture(scope="module")
def model():
    config = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
    torch.manual_seed(0)
    return CausalLM(config)


def _params(opt) -> set[int]:
    return {id(p) for group in opt.param_groups for p in group["params"]}


def test_adamw_trains_every_parameter_once(model):
    """adamw: one AdamW over every trainable parameter (a tied weight once), with the betas
    and weight decay asked for."""
    [opt] = build_optimizer(model, "adamw", 1e-3, weight_decay=0.1, betas=(0.8, 0.9))
    assert isinstance(opt, torch.optim.AdamW)
    assert _params(opt) == {id(p) for p in model.parameters()}
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["weight_decay"] == 0.1


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(model):
    """muon: torch's Muon on every 2-D matrix inside the blocks, AdamW on embeddings, lm_head,
    norms and biases; together they cover every parameter exactly once."""
    muon, adamw = build_optimizer(model, "muon", 1e-3)
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    params = dict(model.named_parameters())
    hidden = set(muon_parameter_names(model))
    assert hidden and all(params[n].ndim == 2 and ".layers." in f".{n}" for n in hidden)
    assert _params(muon) == {id(params[n]) for n in hidden}
    assert _params(muon) | _params(adamw) == {id(p) for p in model.parameters()}
    assert not _params(muon) & _params(adamw)
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'; valid: \\['adamw', 'muon'\\]"):
        build_optimizer(model, "sgd", 1e-3)


@pytest.mark.parametrize("schedule, step, expected", [
    ("constant", 2, 0.1), ("constant", 9, 0.1),
    ("linear", 2, 0.1), ("linear", 6, 0.1 + (0.01 - 0.1) * 0.5), ("linear", 9, 0.01 + 0.09 / 8),
    ("cosine", 2, 0.1), ("cosine", 6, 0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * 0.5))),
])
def test_schedule_values(schedule, step, expected):
    """Warm-up over 2 steps (step i: lr (i + 1) / 2), then constant, linear or cosine decay
    from lr = 0.1 to min_lr = 0.01 over the remaining 8 of 10 steps."""
    assert learning_rate(step, 10, 0.1, 0.01, 2, schedule) == pytest.approx(expected, rel=1e-12)
    assert learning_rate(0, 10, 0.1, 0.01, 2, schedule) == pytest.approx(0.05, rel=1e-12)


def test_set_learning_rate_reaches_every_group(model):
    """set_learning_rate sets the lr of every param group of every optimizer."""
    optimizers = build_optimizer(model, "muon", 1e-3)
    set_learning_rate(optimizers, 0.25)
    assert {g["lr"] for opt in optimizers for g in opt.param_groups} == {0.25}


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_an_optimizer_step_makes_every_quantized_layer_requantize(model, name):
    """The fused AdamW kernel writes parameters without bumping their version counters; the
    optimizer bumps them, so each QuantLinear quantizes the updated master weight at its next
    use (a stale code in the learner's replay is what the replay audit caught)."""
    learner = quantize_model(copy.deepcopy(model), "w8a8-int8", mode="kernel")
    layers = [m for m in learner.modules() if isinstance(m, QuantLinear)]
    opts = build_optimizer(learner, name, 1e-2)
    before = [layer.qweight().codes.clone() for layer in layers]
    for p in learner.parameters():
        p.grad = torch.ones_like(p)
    for opt in opts:
        opt.step()
    assert opts[-1].defaults["fused"] is True
    after = [layer.qweight().codes for layer in layers]
    assert all(layer.quantize_count == 2 for layer in layers)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
