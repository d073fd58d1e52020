"""The gradient pass's logprobs: rows that share a prompt share its forward."""

from __future__ import annotations

import copy

import pytest
import torch

from qarl.model import load_model
from qarl.model.cache import SharedPrefixCache
from qarl.train.learner import logprobs as LP
from qarl.types import RolloutBatch

N, P, L = 8, 6, 5


def _batch() -> RolloutBatch:
    """Two prompts of four responses each, the second left-padded by 2; responses of every
    length from 1 to L (padding after the end)."""
    gen = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(N, P, dtype=torch.bool)
    prompt_mask[4:, :2] = False
    prompt_ids = torch.randint(3, 100, (2, P), generator=gen).repeat_interleave(4, 0)
    prompt_ids = prompt_ids.masked_fill(~prompt_mask, 0)
    response_mask = torch.arange(L)[None, :] < torch.tensor([5, 3, 5, 4, 2, 5, 1, 5])[:, None]
    response_ids = torch.randint(3, 100, (N, L), generator=gen)
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(N, L),
                        finish_reasons=["stop"] * N)


def _logp_and_grads(model, batch, monkeypatch, share: bool):
    model = copy.deepcopy(model)
    if not share:
        monkeypatch.setattr(LP, "_distinct_prompts", lambda b: (None, None))
    logp, entropy = LP.response_logprobs(model, batch)
    weights = torch.randn(N, L, generator=torch.Generator().manual_seed(1))
    (logp * weights).sum().backward()
    monkeypatch.undo()
    return logp.detach(), entropy, {k: p.grad for k, p in model.named_parameters()}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("tiny")


def test_distinct_prompts_found_with_padding_ignored():
    batch = _batch()
    batch.prompt_ids[5, 0] = 7  # under padding: the same prompt
    first, rows = LP._distinct_prompts(batch)
    assert sorted(first.tolist()) == [0, 4]  # each prompt's first row
    assert rows[first].tolist() == [0, 1]
    assert rows.tolist() == [rows[0].item()] * 4 + [rows[4].item()] * 4
    alone = batch.select(torch.tensor([0, 4]))
    assert LP._distinct_prompts(alone)[0] is None  # nothing shared: the one-pass forward


def test_a_shared_prompt_forward_is_the_one_pass_forward(tiny, monkeypatch):
    """The logprobs, entropies and every parameter's gradient equal those of one pass over
    each row's prompt + response, to fp32 rounding (the two differ in GEMM shapes only:
    ~1e-6 relative here)."""
    batch = _batch()
    shared = _logp_and_grads(tiny, batch, monkeypatch, share=True)
    one_pass = _logp_and_grads(tiny, batch, monkeypatch, share=False)
    assert torch.equal(shared[0] == 0, ~batch.response_mask)
    assert torch.allclose(shared[0], one_pass[0], rtol=0, atol=1e-5)
    assert torch.allclose(shared[1], one_pass[1], rtol=0, atol=1e-5)
    for name, grad in one_pass[2].items():
        assert grad is not None and shared[2][name] is not None, name
        assert (shared[2][name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name


def test_prefix_cache_refuses_a_continuation_at_another_slot():
    cache = SharedPrefixCache(torch.tensor([0, 0]))
    k = torch.zeros(1, 1, 3, 4)
    cache.update(0, k, k, 0)
    step = torch.zeros(2, 1, 1, 4)
    with pytest.raises(ValueError, match="starts at slot 2, the prompts fill 3"):
        cache.update(0, step, step, 2)
    keys, _ = cache.update(0, step, step, 3)
    assert keys.shape == (2, 1, 4, 4)


def test_the_gradient_pass_computes_no_response_padding(tiny):
    """Each distinct prompt runs once, and only the response tokens that predict another
    (`Packing`), in one pass (`SharedPrompts`): a layer sees G x P + sum(len - 1) rows in one
    call, not G x P + N x (L - 1)."""
    batch = _batch()
    rows = []
    hook = tiny.model.layers[0].mlp.up_proj.register_forward_hook(
        lambda _m, args, _out: rows.append(args[0].shape[:-1].numel()))
    try:
        logp, _ = LP.response_logprobs(tiny, batch)
    finally:
        hook.remove()
    lengths = batch.response_mask.sum(1)  # [5, 3, 5, 4, 2, 5, 1, 5]
    assert rows == [2 * P + int((lengths - 1).sum())]
    assert torch.equal(logp != 0, batch.response_mask)
