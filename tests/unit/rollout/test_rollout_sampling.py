"""The sampler math in isolation: logprobs, truncation, and the distribution actually drawn."""

from __future__ import annotations

import pytest
import torch

from qarl.rollout.sampling import row_uniforms, sample, token_logprobs, truncate_logits
from qarl.types import SamplingParams


def _u(rows: int, seed: int) -> torch.Tensor:  # [rows] float64 uniforms
    return row_uniforms(seed, 0, rows, 1)[:, 0]


def _logits(rows=6, vocab=50, seed=0, scale=3.0):  # [rows, vocab] float32
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_token_logprobs_is_log_softmax_at_temperature():
    """token_logprobs(z, y, T) = log_softmax(z / T)[y] in fp32 (two fp32 formulas of the same
    quantity: they may differ by a few ulps of values of size ~10, hence 1e-5)."""
    logits = _logits()
    tokens = torch.randint(0, 50, (6,))
    for temperature in (1.0, 0.7, 1.3):
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
        got = token_logprobs(logits, tokens, temperature)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_token_logprobs_leaves_input_untouched_and_upcasts_bf16():
    """The input logits are never modified in place, and bf16 logits give the fp32 logprob of
    their exact fp32 upcast (identical bits to passing the upcast tensor)."""
    logits = _logits().bfloat16()
    before = logits.clone()
    tokens = torch.randint(0, 50, (6,))
    got = token_logprobs(logits, tokens, 0.7)
    assert torch.equal(logits, before)
    assert torch.equal(got, token_logprobs(logits.float(), tokens, 0.7))
    fp32 = _logits()
    fp32_before = fp32.clone()
    token_logprobs(fp32, tokens, 0.7)
    assert torch.equal(fp32, fp32_before)


def test_top_k_one_is_greedy():
    """top_k=1 keeps only the argmax, so every draw equals greedy and has logprob 0."""
    logits = _logits(rows=32)
    greedy, _, _ = sample(logits, SamplingParams(greedy=True), None)
    for seed in range(5):
        tokens, logp, _ = sample(logits, SamplingParams(top_k=1), _u(32, seed))
        assert torch.equal(tokens, greedy)
        assert torch.equal(logp, torch.zeros(32))


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:  # [B, V] bool, float64 ref
    probs = torch.softmax(logits.double(), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep_sorted = sorted_probs.cumsum(-1) - sorted_probs < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def test_top_p_never_samples_outside_the_nucleus():
    """With top_p < 1, 2,000 draws per row all fall in the smallest top-probability set whose
    mass reaches top_p (reference computed independently in float64)."""
    logits = _logits(rows=4, scale=2.0).repeat(500, 1)  # [2000, 50]
    nucleus = _nucleus(logits, 0.6)
    assert nucleus.sum(-1).max() < 50  # the truncation is not vacuous
    tokens, _, _ = sample(logits, SamplingParams(top_p=0.6), _u(2000, 1))
    assert nucleus.gather(-1, tokens[:, None]).all()


def test_truncated_logprob_is_renormalized_probability():
    """With top-k and top-p, the reported logprob is log(p_y / sum of kept p), checked against
    a float64 reference (fp32 vs fp64 on values ~10: 1e-5)."""
    logits = _logits(rows=64, scale=2.0)
    sampling = SamplingParams(temperature=0.8, top_k=20, top_p=0.7)
    tokens, logp, _ = sample(logits, sampling, _u(64, 2))
    scaled = logits.double() / 0.8
    kth = scaled.topk(20, dim=-1).values[:, -1:]
    kept = (scaled >= kth) & _nucleus(scaled.masked_fill(scaled < kth, float("-inf")), 0.7)
    probs = torch.softmax(scaled, dim=-1) * kept
    expected = (probs.gather(-1, tokens[:, None])[:, 0] / probs.sum(-1)).log()
    assert kept.gather(-1, tokens[:, None]).all()
    torch.testing.assert_close(logp.double(), expected, atol=1e-5, rtol=0)


def test_truncate_logits_top_k_keeps_exactly_k_distinct():
    """top-k on distinct logits keeps exactly k entries per row, the k largest."""
    logits = _logits(rows=8)
    kept = truncate_logits(logits, 5, 1.0).isfinite()
    assert torch.equal(kept.sum(-1), torch.full((8,), 5))
    assert torch.equal(kept, logits >= logits.topk(5, dim=-1).values[:, -1:])


@pytest.fixture(params=["native", "torch"])
def sampler_path(request, monkeypatch):
    """Run a test through qarl.native's sampling kernel and through the PyTorch fallback."""
    from qarl import native

    if request.param == "native" and not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    if request.param == "torch":
        monkeypatch.setattr(native, "available", lambda: False)
    return request.param


def test_sampling_frequencies_match_softmax(sampler_path):
    """The inverse-CDF draw follows softmax(z / T): over 40,000 draws each token's frequency is
    within 5 binomial standard deviations of its probability (a -inf token is never drawn)."""
    n = 40_000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]]).repeat(n, 1)
    tokens, _, _ = sample(logits, SamplingParams(temperature=1.5), _u(n, 3))
    probs = torch.softmax(logits[0] / 1.5, dim=-1).double()
    freq = torch.bincount(tokens, minlength=6).double() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma).all(), (freq, probs)
    assert freq[4] == 0


def test_inverse_cdf_edges_and_paths_agree(sampler_path):
    """u = 0 draws the first token with mass, u just below 1 the last one (never a -inf or
    padded position), one finite logit is always drawn; on a 49k vocabulary the native kernel
    and the PyTorch fallback draw the same token for the same uniforms (they differ only where
    a cumulative sum lands within rounding of u * total)."""
    from qarl import native
    from qarl.rollout.sampling import inverse_cdf

    scaled = torch.tensor([[float("-inf"), 1.0, 2.0, float("-inf")],
                           [float("-inf"), float("-inf"), 3.0, float("-inf")]])
    low, high = torch.zeros(2, dtype=torch.float64), torch.full((2,), 1 - 2**-53, dtype=torch.float64)
    assert inverse_cdf(scaled, low).tolist() == [1, 2]
    assert inverse_cdf(scaled, high).tolist() == [2, 2]
    if sampler_path == "native":
        logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)) * 4
        u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        fast = native.sample_rows(logits, 1.0, u)
        probs = (logits - logits.amax(-1, keepdim=True)).double().exp()
        cum = probs.cumsum(-1)
        reference = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0]
        assert (fast == reference).float().mean() >= 0.98
        assert (fast - reference).abs().max() <= 1  # at most a neighbour, at a rounding tie


def test_greedy_logprob_is_raw_log_softmax():
    """Greedy picks the argmax and reports log_softmax of the raw logits (temperature 1)."""
    logits = _logits()
    tokens, logp, _ = sample(logits, SamplingParams(greedy=True, temperature=0.3), None)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(logp, token_logprobs(logits, tokens, 1.0))


def test_same_seed_same_draws_and_seeds_differ():
    """Draws depend only on the uniforms: same seed, same tokens; another seed, other tokens."""
    logits = _logits(rows=64)

    def draw(seed: int) -> torch.Tensor:
        return sample(logits, SamplingParams(), _u(64, seed))[0]

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


def test_row_streams_do_not_depend_on_the_batch():
    """Row r's uniforms are a function of (seed, r) only: a slice of rows starting at any
    offset, or a shorter run of steps, gives exactly the corresponding part of the full
    table; rows and seeds differ from each other."""
    full = row_uniforms(11, 0, 8, 20)  # [8, 20]
    assert torch.equal(row_uniforms(11, 3, 2, 20), full[3:5])
    assert torch.equal(row_uniforms(11, 5, 3, 7), full[5:8, :7])
    assert len({tuple(r.tolist()) for r in full}) == 8
    assert not torch.equal(row_uniforms(12, 0, 8, 20), full)
    assert ((full >= 0) & (full < 1)).all()


def test_nonpositive_temperature_needs_greedy():
    """SamplingParams refuses temperature <= 0 when sampling and says to use greedy."""
    with pytest.raises(ValueError, match=r"temperature must be > 0 when sampling, got 0.*greedy=True"):
        SamplingParams(temperature=0.0)
