"""Mismatch and error-token diagnostics on hand-made inputs with known answers."""

import math

import pytest
import torch

from qarl.algo.diagnostics import (
    error_token_metrics,
    garbled,
    has_repeat_run,
    lowprob_tokens,
    mismatch_by_position,
    mismatch_metrics,
    rep_ngram,
    rep_run,
    truncated,
)
from qarl.types import FINISH_LENGTH


def _mask(lengths, width):
    return torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def test_identical_logp_gives_zero_mismatch():
    """old == rollout: |Δ| = 0, k3 = 0 and every sequence ratio is exactly 1."""
    logp = -torch.rand(3, 5, generator=torch.Generator().manual_seed(0))
    m = mismatch_metrics(logp, logp.clone(), _mask([5, 3, 1], 5))
    assert m == {"abs_diff_mean": 0.0, "abs_diff_max": 0.0, "k3_kl": 0.0,
                 "seq_ratio_mean": 1.0, "seq_ratio_min": 1.0, "seq_ratio_max": 1.0}


def test_known_delta_gives_known_k3_and_ratios():
    """A constant Δ = log r on every token gives k3 = (r − 1) − log r, ρ = r; padding with a
    huge planted Δ is ignored."""
    delta = 0.1
    rollout = torch.full((2, 4), -1.0)
    old = rollout + delta
    old[1, 2:] = 50.0  # padding of row 1
    m = mismatch_metrics(old, rollout, _mask([4, 2], 4))
    assert m["k3_kl"] == pytest.approx(math.expm1(delta) - delta, rel=1e-5)
    assert m["abs_diff_mean"] == pytest.approx(delta, rel=1e-5)
    assert m["abs_diff_max"] == pytest.approx(delta, rel=1e-5)
    assert m["seq_ratio_min"] == pytest.approx(math.exp(delta), rel=1e-6)
    assert m["seq_ratio_max"] == pytest.approx(math.exp(delta), rel=1e-6)


def test_sequence_ratio_is_the_geometric_mean_per_row():
    """ρ_i = exp(mean_t Δ) per row: rows with Δ = (+0.2, 0) and (−0.4) give e^0.1 and e^−0.4."""
    rollout = torch.zeros(2, 2)
    old = torch.tensor([[0.2, 0.0], [-0.4, 9.0]])
    m = mismatch_metrics(old, rollout, _mask([2, 1], 2))
    assert m["seq_ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-6)
    assert m["seq_ratio_min"] == pytest.approx(math.exp(-0.4), rel=1e-6)
    assert m["seq_ratio_mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.4)) / 2, rel=1e-6)
    # k3 per token: [(e^.2 − 1) − .2, 0, (e^−.4 − 1) + .4] averaged over 3 tokens
    k3 = (math.expm1(0.2) - 0.2 + math.expm1(-0.4) + 0.4) / 3
    assert m["k3_kl"] == pytest.approx(k3, rel=1e-6)


def test_empty_mask_gives_nan_not_zero():
    """No response token: the mismatch statistics are nan, not a made-up 0."""
    m = mismatch_metrics(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert all(math.isnan(v) for v in m.values())


def test_mismatch_by_position_buckets():
    """Mean |Δ| per position bucket: Δ grows with position, buckets see their own tokens only."""
    rollout = torch.zeros(2, 6)
    old = torch.tensor([[1.0, 1.0, 2.0, 2.0, 3.0, 3.0], [1.0, 1.0, 2.0, 0.0, 0.0, 0.0]])
    out = mismatch_by_position(old, rollout, _mask([6, 3], 6), buckets=(0, 2, 4, 8))
    assert list(out) == ["0-1", "2-3", "4-7", "8+"]
    assert out["0-1"] == 1.0 and out["2-3"] == 2.0 and out["4-7"] == 3.0
    assert math.isnan(out["8+"])
    with pytest.raises(ValueError, match="strictly increasing"):
        mismatch_by_position(old, rollout, _mask([6, 3], 6), buckets=(1, 4))


def test_rep_ngram_counts_repeated_four_grams():
    """'1 2 3 4 1 2 3 4' has 5 four-grams of which 1 repeats an earlier one; padding with
    the same ids does not count; a second row without repeats adds 3 fresh four-grams."""
    ids = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4],
                        [5, 6, 7, 8, 9, 10, 0, 0, 0, 0, 0, 0]])
    mask = _mask([8, 6], 12)
    assert rep_ngram(ids, mask) == pytest.approx(1 / 8)
    assert rep_ngram(ids[1:], mask[1:]) == 0.0
    assert math.isnan(rep_ngram(ids[:, :3], mask[:, :3]))


def test_rep_ngram_is_per_response():
    """The same 4-gram in two different responses is not a repeat."""
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    assert rep_ngram(ids, _mask([4, 4], 4)) == 0.0


def test_rep_run_finds_runs_of_identical_ngrams():
    """Four identical 1-, 2- or 3-grams in a row are runs; three are not; padding is not."""
    width = 14
    rows = {
        "to to to to": [7, 7, 7, 7, 1],
        "three only": [7, 7, 7, 1, 2],
        "bigram x4": [1, 5, 6, 5, 6, 5, 6, 5, 6, 2],
        "bigram x3": [1, 5, 6, 5, 6, 5, 6, 2],
        "trigram x4": [5, 6, 8, 5, 6, 8, 5, 6, 8, 5, 6, 8],
        "run in padding": [3, 4],
    }
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, toks in enumerate(rows.values()):
        ids[i, : len(toks)] = torch.tensor(toks)
    mask = _mask([len(t) for t in rows.values()], width)
    found = has_repeat_run(ids, mask)
    assert dict(zip(rows, found.tolist())) == {
        "to to to to": True, "three only": False, "bigram x4": True, "bigram x3": False,
        "trigram x4": True, "run in padding": False}
    assert rep_run(ids, mask) == pytest.approx(3 / 6)


def test_truncated_lowprob_and_garbled():
    """truncated counts 'length' finishes; a planted p = 1e-4 token among 5 is 1/5 low-prob
    (padding ignored); garbled counts failing grammar verdicts."""
    assert truncated(["stop", FINISH_LENGTH, "stop", "stop"]) == 0.25
    logp = torch.log(torch.tensor([[0.5, 0.9, 1e-4], [0.2, 0.002, 1e-9]]))
    assert lowprob_tokens(logp, _mask([3, 2], 3)) == pytest.approx(1 / 5)
    assert garbled([True, False, False, True]) == 0.5
    assert math.isnan(truncated([])) and math.isnan(garbled([]))


def test_error_token_metrics_reports_what_it_has_inputs_for():
    """error_token_metrics returns every metric with inputs, and leaves out the others."""
    ids = torch.tensor([[7, 7, 7, 7, 0], [1, 2, 3, 4, 5]])
    mask = _mask([4, 5], 5)
    base = error_token_metrics(ids, mask, ["stop", "length"])
    assert set(base) == {"rep_ngram", "rep_run", "truncated"}
    assert base["rep_run"] == 0.5 and base["truncated"] == 0.5 and base["rep_ngram"] == 0.0
    full = error_token_metrics(ids, mask, ["stop", "length"],
                               learner_logp=torch.zeros(2, 5), grammar_ok=[True, True])
    assert full["lowprob_tokens"] == 0.0 and full["garbled"] == 0.0
    assert all(isinstance(v, float) for v in full.values())
