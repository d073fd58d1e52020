"""Truncated sampling (top-k, top-p, min-p): what the sampler keeps, what it records, and the
learner's logprobs under the same truncated distribution."""

from __future__ import annotations

import math

import pytest
import torch

from qarl.rollout.engine import LocalEngine
from qarl.rollout.sampling import kept_logprobs, sample, token_logprobs, truncate_logits
from qarl.train.learner.logprobs import response_logprobs
from qarl.types import RolloutBatch, SamplingParams, concat_batches


def _u(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_min_p_keeps_exactly_the_tokens_at_least_min_p_times_the_most_likely():
    """p = softmax([2, 1, 0, -3]) = [.6572, .2418, .0889, .0120]; min_p 0.13 keeps tokens
    with p >= 0.0854: the first three."""
    z = torch.tensor([[2.0, 1.0, 0.0, -3.0]])
    kept = truncate_logits(z, top_k=0, top_p=1.0, min_p=0.13) != -math.inf
    assert kept.tolist() == [[True, True, True, False]]
    p = torch.softmax(z, -1)
    assert torch.equal(kept, p >= 0.13 * p.max())


def test_kept_logprobs_equal_a_direct_computation():
    """log p(y) = z_y / T - log sum_{v in kept} exp(z_v / T), on fixed logits and kept sets."""
    z = torch.tensor([[1.0, 3.0, 0.5, -1.0], [0.0, 0.0, 2.0, 1.0]])
    kept = torch.tensor([[True, True, False, False], [False, True, True, True]])
    tokens = torch.tensor([0, 2])
    T = 0.7
    got = kept_logprobs(z, tokens, T, kept)
    want = torch.tensor([1.0 / T - math.log(math.exp(1 / T) + math.exp(3 / T)),
                         2.0 / T - math.log(1 + math.exp(2 / T) + math.exp(1 / T))])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_gradient_flows_through_the_kept_tokens_logits_only():
    z = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()
    kept = torch.zeros(3, 16, dtype=torch.bool)
    kept[:, :5] = True
    kept_logprobs(z, torch.tensor([0, 3, 4]), 1.0, kept).sum().backward()
    assert torch.all(z.grad[:, 5:] == 0) and torch.all(z.grad[:, :5].abs().sum(-1) > 0)


@pytest.mark.parametrize("settings", [dict(top_p=0.7), dict(top_k=5), dict(min_p=0.1),
                                      dict(top_k=12, top_p=0.9, min_p=0.02, temperature=0.8)])
def test_sample_reports_its_kept_set_and_its_logprob_is_the_kept_logprob(settings):
    """The kept set `sample` returns is the finite part of the truncated logits, and its
    logprob is `kept_logprobs` under that set bit for bit."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1)) * 3
    sampling = SamplingParams(**settings)
    tokens, logp, kept = sample(logits, sampling, _u(64, 2))
    scaled = truncate_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p,
                             sampling.min_p)
    assert torch.equal(kept, scaled != -math.inf) and kept[torch.arange(64), tokens].all()
    assert kept.sum(-1).lt(50).all()
    assert torch.equal(logp, kept_logprobs(logits, tokens, sampling.temperature, kept))


def test_the_biased_ratio_is_the_kept_mass():
    """A learner over the whole vocabulary against a sampler truncated to mass M: its ratio
    exp(logp_full - logp_sampler) is p_y / (p_y / M) = M at every token."""
    z = torch.tensor([[2.0, 1.0, 0.5, -1.0, -2.0]] * 3)
    tokens = torch.tensor([0, 1, 1])
    sampling = SamplingParams(top_p=0.8)
    kept = truncate_logits(z, 0, 0.8) != -math.inf
    p = torch.softmax(z, -1)
    mass = (p * kept).sum(-1)  # [3]
    assert kept[0].tolist() == [True, True, False, False, False]  # mass .6027 + .2217
    ratio = torch.exp(token_logprobs(z, tokens) - kept_logprobs(z, tokens, 1.0, kept))
    torch.testing.assert_close(ratio, mass, rtol=1e-6, atol=0)
    drawn, sampler_logp, _ = sample(z, sampling, _u(3, 0))
    torch.testing.assert_close(torch.exp(token_logprobs(z, drawn) - sampler_logp), mass,
                               rtol=1e-6, atol=0)


@pytest.fixture
def engine(make_model):
    """A LocalEngine around a small random decoder; engine(seed) for other weights."""
    return lambda seed=0: LocalEngine(make_model(seed=seed), eos_token_ids=[1], pad_token_id=0)


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]] * 2


def test_generate_records_the_kept_sets_and_score_reproduces_the_sampler_bit_for_bit(engine):
    """Each recorded position's kept set is the sampler's (recomputed from the same logits by
    scoring under it gives rollout_logp exactly), padding records nothing, and the batch's
    select / concat keep each row's sets."""
    engine = engine()
    sampling = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.8, top_k=40)
    batch = engine.generate(PROMPTS, sampling, seed=3)
    counts = batch.kept_counts
    assert counts.shape == batch.response_mask.shape and counts.dtype == torch.int32
    assert torch.equal(counts > 0, batch.response_mask)
    assert int(counts.sum()) == batch.kept_ids.numel() and counts.max() <= 40
    assert torch.equal(engine.score(batch, sampling), batch.rollout_logp)
    # the sampled token is in its kept set at every position
    V = engine.model.config.vocab_size
    masks = batch.kept_token_mask(V)
    assert masks[torch.arange(masks.shape[0]), batch.response_ids[batch.response_mask]].all()
    # select and concat keep each row's sets
    order = torch.tensor([5, 0, 3])
    picked = batch.select(order)
    for i, r in enumerate(order.tolist()):
        for t in range(batch.response_ids.shape[1]):
            assert torch.equal(picked.kept_mask(torch.tensor([i]), t, V),
                               batch.kept_mask(torch.tensor([r]), t, V))
    joined = concat_batches([batch.select(torch.arange(4)), batch.select(torch.arange(4, 8))], 0)
    assert torch.equal(joined.kept_counts, batch.kept_counts)
    assert torch.equal(joined.kept_ids, batch.kept_ids)
    assert torch.equal(engine.score(joined, sampling), batch.rollout_logp)


def test_score_uses_the_recorded_sets_not_its_own_truncation(engine):
    """A model that differs from the sampler's (here: other weights) scores each token under
    the sampler's kept set, so its logprobs equal a direct computation on its own logits with
    the recorded sets, not with its own top-p."""
    sampler, other = engine(0), engine(1)
    sampling = SamplingParams(max_new_tokens=5, top_p=0.6)
    batch = sampler.generate(PROMPTS, sampling, seed=4)
    scored = other.score(batch, sampling)
    V = other.model.config.vocab_size
    with torch.no_grad():
        logits = other.model.lm_head(other.model(batch.sequence_ids(),
                                                 key_mask=batch.sequence_mask()))
    P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    predicting = logits[:, P - 1 : P - 1 + L][batch.response_mask]  # [T, V]
    want = kept_logprobs(predicting, batch.response_ids[batch.response_mask], 1.0,
                         batch.kept_token_mask(V))
    torch.testing.assert_close(scored[batch.response_mask], want, rtol=0, atol=5e-5)
    own = other.score(batch.without_kept(), sampling)
    assert not torch.allclose(own[batch.response_mask], want, atol=1e-3)


def test_the_learners_forward_scores_under_the_kept_sets_with_their_gradient(engine):
    """response_logprobs on a batch with kept sets: values equal the engine-path score of the
    same model (to GEMM rounding), gradients only reach the kept tokens' lm_head rows."""
    engine = engine()
    sampling = SamplingParams(max_new_tokens=5, top_k=3)
    batch = engine.generate(PROMPTS, sampling, seed=5)
    model = engine.model
    model.requires_grad_(True)
    logp, entropy = response_logprobs(model, batch, sampling.temperature, chunk_tokens=7)
    torch.testing.assert_close(logp, engine.score(batch, sampling), rtol=0, atol=5e-5)
    assert torch.all(entropy[batch.response_mask] <= math.log(3) + 1e-5)
    logp.sum().backward()
    kept_anywhere = batch.kept_token_mask(model.config.vocab_size).any(0)
    grad = model.lm_head.weight.grad
    assert torch.all(grad[~kept_anywhere] == 0) and grad[kept_anywhere].abs().sum() > 0


def test_an_untruncated_batch_records_nothing(engine):
    batch = engine().generate(PROMPTS, SamplingParams(max_new_tokens=4), seed=0)
    assert batch.kept_counts is None and batch.kept_ids is None
    assert isinstance(batch, RolloutBatch)
