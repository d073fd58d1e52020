"""A tied embedding's gradient rows added straight into the weight's gradient
(qarl.train.learner.embedding): the same gradient as autograd's dense embedding backward, in
another summation order, over micro-batches that accumulate."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qarl.model import load_model
from qarl.train.learner import logprobs as LP
from qarl.train.learner.embedding import RowsEmbedding, rows_into_gradient
from qarl.types import RolloutBatch

N, P, L = 8, 6, 5


def _batch(seed: int) -> RolloutBatch:
    """Two prompts of four responses each; responses of several lengths."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, 100, (2, P), generator=gen).repeat_interleave(4, 0)
    response_mask = torch.arange(L)[None, :] < torch.tensor([5, 3, 5, 4, 2, 5, 1, 5])[:, None]
    response_ids = torch.randint(3, 100, (N, L), generator=gen)
    return RolloutBatch(prompt_ids, torch.ones(N, P, dtype=torch.bool), response_ids,
                        response_mask, torch.zeros(N, L), finish_reasons=["stop"] * N)


def _grads(model, rows: bool, copied: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's gradient after two micro-batches' backward passes, accumulated;
    copied: of a deep copy of the model taken after the embedding was set up."""
    model = copy.deepcopy(model)
    assert rows_into_gradient(model, rows) is rows
    if copied:
        LP.response_logprobs(model, _batch(0))  # the original hooks its weight first
        model = copy.deepcopy(model)
    for seed in (0, 1):
        logp, _ = LP.response_logprobs(model, _batch(seed))
        weights = torch.randn(N, L, generator=torch.Generator().manual_seed(10 + seed))
        (logp * weights).sum().backward()
    embed = model.model.embed_tokens
    assert not getattr(embed, "pending", [])  # every call's rows added
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = load_model("tiny")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    return model


def test_rows_into_the_gradient_equal_autograds_dense_embedding_backward(tiny):
    """Every gradient equals autograd's to fp32 summation order (the tied weight's sums its
    lm_head, prompt and response parts in another order: a few ulps of its largest entry),
    the other parameters' bit for bit."""
    dense = _grads(tiny, rows=False)
    tied = "model.embed_tokens.weight"
    for rows in (_grads(tiny, rows=True), _grads(tiny, rows=True, copied=True)):
        for name, grad in dense.items():
            if name == tied:
                assert (rows[name] - grad).abs().max() <= 1e-6 * grad.abs().max()
                assert not torch.equal(grad, torch.zeros_like(grad))
            else:
                assert torch.equal(rows[name], grad), name


def test_the_tie_names_and_parameters_survive(tiny):
    model = copy.deepcopy(tiny)
    names = list(model.state_dict())
    params = list(model.parameters())
    rows_into_gradient(model, True)
    embed = model.model.embed_tokens
    assert isinstance(embed, RowsEmbedding) and embed.on
    assert model.lm_head.weight is embed.weight
    assert list(model.state_dict()) == names
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    rows_into_gradient(model, False)  # learner ranks: autograd's own path again
    assert model.model.embed_tokens is embed and not embed.on
    plain = copy.deepcopy(tiny)
    assert rows_into_gradient(plain, False) is False  # off: the module stays nn.Embedding
    assert type(plain.model.embed_tokens) is nn.Embedding


def test_an_untied_or_frozen_embedding_keeps_autograds_path(tiny):
    untied = copy.deepcopy(tiny)
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach().clone())
    assert rows_into_gradient(untied, True) is False
    assert type(untied.model.embed_tokens) is nn.Embedding
    base = copy.deepcopy(tiny)
    base.model.embed_tokens.weight.requires_grad_(False)  # LoRA's frozen base
    assert rows_into_gradient(base, True) is False
    assert type(base.model.embed_tokens) is nn.Embedding
    frozen = copy.deepcopy(tiny)
    rows_into_gradient(frozen, True)
    frozen.model.embed_tokens.weight.requires_grad_(False)  # LoRA: the base stays
    ids = torch.tensor([[3, 4, 5]])
    out = frozen.model.embed_tokens(ids)
    assert torch.equal(out, torch.nn.functional.embedding(ids, frozen.model.embed_tokens.weight))
    assert not frozen.model.embed_tokens.pending
