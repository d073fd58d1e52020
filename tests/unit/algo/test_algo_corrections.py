"""Rollout corrections against hand-computed weights, masks and metrics.

Token ratios r = π_old / π_μ are set exactly: rollout_logp = 0, old_logp = log r.
Corrections compute in float32, hence the 1e-6 relative tolerances."""

import math

import pytest
import torch

from qarl.algo import CORRECTIONS, apply_corrections, compose


def _ratios(rows, lengths=None):
    old = torch.log(torch.tensor(rows, dtype=torch.float32))
    mu = torch.zeros_like(old)
    if lengths is None:
        mask = torch.ones_like(old, dtype=torch.bool)
    else:
        mask = torch.arange(old.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    return old, mu, mask


def _close(t, expected):
    torch.testing.assert_close(t, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=1e-7)


def test_tis_token_truncates_at_cap():
    """r = [0.5, 1, 3], cap 2: w = [0.5, 1, 2]; nothing masked; 1/3 clipped; raw max 3;
    ESS = (0.5+1+2)² / (3·(0.25+1+4)) = 12.25 / 15.75."""
    c = CORRECTIONS["tis_token"](*_ratios([[0.5, 1.0, 3.0]]))
    _close(c.weights, [[0.5, 1.0, 2.0]])
    _close(c.mask, [[1.0, 1.0, 1.0]])
    m = c.metrics
    assert m["clipped_frac"].item() == pytest.approx(1 / 3)
    assert m["ratio_max"].item() == pytest.approx(3.0, rel=1e-6)
    assert m["masked_frac"].item() == 0.0
    assert m["ess"].item() == pytest.approx(12.25 / 15.75, rel=1e-6)


def test_tis_seq_geometric_and_product_forms():
    """Token ratios [2, 8], cap 5: geometric ρ = exp((log 2 + log 8)/2) = 4 -> w = 4 on both
    tokens; product ρ = 16 -> w = 5 (truncated)."""
    inputs = _ratios([[2.0, 8.0]])
    _close(CORRECTIONS["tis_seq"](*inputs, cap=5.0).weights, [[4.0, 4.0]])
    prod = CORRECTIONS["tis_seq"](*inputs, cap=5.0, form="product")
    _close(prod.weights, [[5.0, 5.0]])
    assert prod.metrics["ratio_mean"].item() == pytest.approx(16.0, rel=1e-6)
    assert prod.metrics["clipped_frac"].item() == 1.0


def test_mis_token_rejects_outside_range():
    """r = [0.4, 1, 2.5, 2], range [0.5, 2]: tokens 0 and 2 rejected (mask 0, weight 0),
    kept tokens weighted by r; half the tokens masked."""
    c = CORRECTIONS["mis_token"](*_ratios([[0.4, 1.0, 2.5, 2.0]]))
    _close(c.mask, [[0.0, 1.0, 0.0, 1.0]])
    _close(c.weights, [[0.0, 1.0, 0.0, 2.0]])
    assert c.metrics["masked_frac"].item() == 0.5
    assert c.metrics["ratio_min"].item() == pytest.approx(0.4, rel=1e-6)


def test_mis_seq_rejects_whole_sequences_by_product():
    """Row 0: 1.5·1.5 = 2.25 > 2 -> rejected; row 1: 1.2·0.9 = 1.08 -> kept, w = 1.08;
    row 2 has one real token (padding ignored): 1.9 -> kept."""
    c = CORRECTIONS["mis_seq"](*_ratios([[1.5, 1.5], [1.2, 0.9], [1.9, 50.0]], lengths=[2, 2, 1]))
    _close(c.mask, [[0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    _close(c.weights, [[0.0, 0.0], [1.08, 1.08], [1.9, 0.0]])
    assert c.metrics["masked_frac"].item() == pytest.approx(1 / 3)


def test_geo_mask_uses_geometric_mean():
    """Bounds [0.999, 1.001]: row 0 log-ratios [5e-4, 5e-4] -> exp(5e-4) kept; row 1
    [3e-3, −1e-3] -> exp(1e-3) = 1.0010005 > 1.001 rejected. Weights are 1."""
    old = torch.tensor([[5e-4, 5e-4], [3e-3, -1e-3]])
    c = CORRECTIONS["geo_mask"](old, torch.zeros_like(old), torch.ones_like(old, dtype=torch.bool))
    _close(c.mask, [[1.0, 1.0], [0.0, 0.0]])
    _close(c.weights, [[1.0, 1.0], [0.0, 0.0]])


def test_opsm_drops_only_negative_advantage_off_policy_sequences():
    """δ = 1e-4, mean(logp_μ − logp_θ): row 0 2e-4 with A < 0 -> dropped; row 1 same with
    A > 0 -> kept; row 2 5e-5 with A < 0 -> kept. With logp given, logp replaces old_logp."""
    mu = torch.tensor([[2e-4, 2e-4], [2e-4, 2e-4], [5e-5, 5e-5]])
    old = torch.zeros_like(mu)
    mask = torch.ones_like(mu, dtype=torch.bool)
    adv = torch.tensor([-1.0, 1.0, -1.0])
    c = CORRECTIONS["opsm"](old, mu, mask, adv)
    _close(c.mask, [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    assert c.metrics["masked_frac"].item() == pytest.approx(1 / 3)
    c2 = CORRECTIONS["opsm"](old, mu, mask, adv, logp=mu.clone())  # π_θ = π_μ: nothing off-policy
    _close(c2.mask, [[1.0, 1.0]] * 3)
    with pytest.raises(ValueError, match="advantages"):
        CORRECTIONS["opsm"](old, mu, mask)


def test_compose_multiplies_and_prefixes():
    """tis_token then mis_token on r = [0.4, 3, 1.5]: weights min(r, 2)·(r if kept) with
    mis range [0.5, 2] -> [0, 0, 1.5·1.5]; masks multiply; metric names get the prefix."""
    inputs = _ratios([[0.4, 3.0, 1.5]])
    c = apply_corrections({"tis_token": {}, "mis_token": {}}, *inputs)
    _close(c.weights, [[0.0, 0.0, 2.25]])
    _close(c.mask, [[0.0, 0.0, 1.0]])
    assert "tis_token/ess" in c.metrics and "mis_token/masked_frac" in c.metrics
    empty = compose({}, inputs[2])
    _close(empty.weights, [[1.0, 1.0, 1.0]])
    assert empty.metrics == {}


def test_huge_mismatch_stays_finite():
    """A log-ratio of 1000 (ratio overflows float32) is bounded at exp(20): weights and
    metrics stay finite."""
    old = torch.tensor([[1000.0, 0.0]])
    c = CORRECTIONS["tis_seq"](old, torch.zeros_like(old), torch.ones_like(old), form="product")
    assert all(math.isfinite(v.item()) for v in c.metrics.values())
    assert torch.isfinite(c.weights).all()
