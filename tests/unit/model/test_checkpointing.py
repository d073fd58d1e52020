"""Gradient checkpointing of the decoder layers (qarl.model.decoder.checkpointed_layers)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from qarl.model import CausalLM, ModelConfig
from qarl.model.decoder import checkpointed_layers

CONFIG = ModelConfig(family="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
                     num_layers=3, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)


def _backward(model, ids, context):
    """Loss backward of one forward; (gradients, layer-0 forward calls, bytes autograd saved)."""
    calls, saved = [], []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    model.zero_grad(set_to_none=True)
    with checkpointed_layers(model, context), torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        loss = model.logits(ids).logsumexp(-1).mean()
    loss.backward()
    hook.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls), sum(saved)


def test_recomputes_each_layer_and_keeps_less_with_the_same_gradients():
    """With checkpointing each layer runs twice (forward, recompute in backward), autograd
    keeps less than half the bytes, and every gradient is bit-identical; outside the context,
    and without gradients, nothing is recomputed."""
    torch.manual_seed(0)
    model = CausalLM(CONFIG)
    ids = torch.randint(0, 96, (4, 24))
    plain, plain_calls, plain_saved = _backward(model, ids, None)
    ckpt, ckpt_calls, ckpt_saved = _backward(model, ids, nullcontext)
    assert (plain_calls, ckpt_calls) == (1, 2)
    assert ckpt_saved < 0.5 * plain_saved
    for name, grad in plain.items():
        assert torch.equal(ckpt[name], grad), name
    assert model.recompute_context is None
    with checkpointed_layers(model, nullcontext), torch.no_grad():
        calls = []
        hook = model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
        model.logits(ids)
        hook.remove()
    assert calls == [1]


def test_the_recompute_runs_inside_the_given_context():
    """The recompute enters the context it was given (the gradient pass's precision and GEMM
    library in training), once per layer."""
    entered = []

    class Marked:
        def __enter__(self):
            entered.append(1)

        def __exit__(self, *exc):
            return False

    model = CausalLM(CONFIG)
    _backward(model, torch.randint(0, 96, (2, 8)), Marked)
    assert len(entered) == CONFIG.num_layers
