"""Sequence-level losses (gspo, tbpo) against hand-computed values, their zero-gradient
regions, and length safety. float64 throughout; token log-ratios are chosen directly:
logp = d (the per-token log-ratio), old_logp = 0, rollout_logp = −log ρ (so ρ is exact)."""

import math

import pytest
import torch

from qarl.algo import CORRECTIONS, LOSSES

F64 = dict(dtype=torch.float64)


def _rows(log_ratios, advantages, rhos=None):
    """Per-row token log-ratios (equal lengths) -> (logp, old, rollout, adv, mask)."""
    logp = torch.tensor(log_ratios, **F64).requires_grad_(True)
    old = torch.zeros_like(logp)
    rho = torch.ones(logp.shape[0], **F64) if rhos is None else torch.tensor(rhos, **F64)
    rollout = (-torch.log(rho))[:, None].expand_as(old).clone()
    mask = torch.ones_like(old, dtype=torch.bool)
    return logp, old, rollout, torch.tensor(advantages, **F64), mask


@pytest.mark.parametrize(
    "d, adv, expected_loss, grad_zero",
    [
        # mean d = 3e-4 -> s = e^3e-4 inside [1 − 3e-4, 1 + 4e-4]: ℓ = −s, gradient −s/3 per token
        ([1e-3, 2e-4, -3e-4], 1.0, -math.exp(3e-4), False),
        # mean d = 1e-3 -> s > 1 + 4e-4: clipped above, ℓ = −1.0004, no gradient
        ([1e-3, 1e-3, 1e-3], 1.0, -(1 + 4e-4), True),
        # mean d = −1e-3, A > 0: min keeps s·A, ℓ = −s, gradient flows
        ([-1e-3, -1e-3, -1e-3], 1.0, -math.exp(-1e-3), False),
        # mean d = −1e-3, A < 0: ℓ = max(s, 1 − 3e-4) = 0.9997, clipped below, no gradient
        ([-1e-3, -1e-3, -1e-3], -1.0, 1 - 3e-4, True),
        # mean d = 1e-3, A < 0: ℓ = max(s, clip) = s, no upper clip in GSPO for negatives
        ([1e-3, 1e-3, 1e-3], -1.0, math.exp(1e-3), False),
    ],
)
def test_gspo_branches(d, adv, expected_loss, grad_zero):
    """GSPO ℓ = −min(s·A, clip(s, 1−3e-4, 1+4e-4)·A) with s = exp(mean d); clipped
    sequences get exactly zero gradient, the others d ℓ / d logp_t = −A·s/3."""
    logp, old, mu, a, mask = _rows([d], [adv])
    loss, m = LOSSES["gspo"](logp, old, mu, a, mask)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    loss.backward()
    if grad_zero:
        assert torch.equal(logp.grad, torch.zeros_like(logp.grad))
        assert m["clip_frac"].item() == 1.0
    else:
        s = math.exp(sum(d) / 3)
        expected_grad = torch.full((1, 3), -adv * s / 3, **F64)
        torch.testing.assert_close(logp.grad, expected_grad, rtol=0, atol=1e-12)
        assert m["clip_frac"].item() == 0.0


def _tbpo_batch():
    """Five sequences of 2 tokens (mean token log-ratio, A, ρ):
    0: (2e-4, +1, 1.5)  kept, w = 1.5, s inside          -> w·ℓ = −1.5·e^2e-4
    1: (0,    −1, 3.0)  ρ > band_high 2.0: dropped        -> not counted
    2: (5e-4, −1, 0.8)  kept, w = 0.8, s inside neg band  -> w·ℓ = 0.8·e^5e-4
    3: (1e-3, −1, 1.0)  s > 1 + 7e-4: clipped above       -> ℓ = 1.0007, no gradient
    4: (−1e-3, −1, 1.0) s < 1 − 3e-4: clipped below       -> ℓ = 0.9997, no gradient"""
    d = [2e-4, 0.0, 5e-4, 1e-3, -1e-3]
    return _rows([[x, x] for x in d], [1.0, -1.0, -1.0, -1.0, -1.0], [1.5, 3.0, 0.8, 1.0, 1.0])


def test_tbpo_hand_value_and_gradients():
    """L = Σ_kept w·ℓ / 4 (4 sequences kept). Gradients: −1.5·s/(2·4) on row 0,
    0.8·s/(2·4) on row 2, exactly 0 on the dropped row and the two out-of-band negatives."""
    logp, old, mu, adv, mask = _tbpo_batch()
    loss, m = LOSSES["tbpo"](logp, old, mu, adv, mask)
    s0, s2 = math.exp(2e-4), math.exp(5e-4)
    expected = (-1.5 * s0 + 0.8 * s2 + (1 + 7e-4) + (1 - 3e-4)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    loss.backward()
    g = logp.grad
    torch.testing.assert_close(g[0], torch.full((2,), -1.5 * s0 / 8, **F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(g[2], torch.full((2,), 0.8 * s2 / 8, **F64), rtol=0, atol=1e-12)
    for row in (1, 3, 4):
        assert torch.equal(g[row], torch.zeros(2, **F64)), row
    assert m["band_drop_frac"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_neg"].item() == pytest.approx(2 / 3)
    assert m["clip_frac_pos"].item() == 0.0
    assert m["mismatch_ratio_max"].item() == pytest.approx(3.0)


def test_tbpo_band_low_side_drops_too():
    """A sequence with ρ = 0.4 < band_low 0.5 is dropped: zero gradient, not in the mean."""
    logp, old, mu, adv, mask = _rows([[1e-4, 1e-4], [1e-4, 1e-4]], [1.0, 1.0], [0.4, 1.0])
    loss, m = LOSSES["tbpo"](logp, old, mu, adv, mask)
    assert loss.item() == pytest.approx(-math.exp(1e-4), abs=1e-12)  # only row 1, divided by 1
    loss.backward()
    assert torch.equal(logp.grad[0], torch.zeros(2, **F64))
    assert m["band_drop_frac"].item() == 0.5


def test_tbpo_mismatch_weight_is_capped_and_has_no_gradient():
    """With band_high = 4, ρ = 3 is kept and weighted by min(3, is_cap 2) = 2: the loss is
    exactly twice that of ρ = 1. old_logp and rollout_logp receive no gradient at all."""
    logp, old, mu, adv, mask = _rows([[1e-4, 1e-4]], [1.0], [3.0])
    old.requires_grad_(True)
    mu.requires_grad_(True)
    loss, m = LOSSES["tbpo"](logp, old, mu, adv, mask, band_high=4.0)
    loss.backward()
    assert old.grad is None and mu.grad is None
    assert m["mismatch_weight_max"].item() == 2.0
    logp1, old1, mu1, _, _ = _rows([[1e-4, 1e-4]], [1.0], [1.0])
    base, _ = LOSSES["tbpo"](logp1, old1, mu1, adv, mask, band_high=4.0)
    assert loss.item() == pytest.approx(2 * base.item(), abs=1e-12)


def test_tbpo_all_dropped_gives_zero_loss():
    """Every sequence outside the band: loss 0 (denominator max(1, 0)), gradient zero."""
    logp, old, mu, adv, mask = _rows([[1e-4, 1e-4]], [1.0], [10.0])
    loss, m = LOSSES["tbpo"](logp, old, mu, adv, mask)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp.grad))
    assert m["band_drop_frac"].item() == 1.0


def _doubled(t):  # every token repeated: [N, L] -> [N, 2L]
    return t.repeat_interleave(2, dim=1)


@pytest.mark.parametrize("name", ["gspo", "tbpo"])
def test_sequence_ratio_is_length_safe(name):
    """Repeating every token (same per-token log-ratios, twice the length) leaves the
    sequence ratio, the mismatch ratio and the loss unchanged."""
    d = torch.tensor([[1e-4, -2e-4, 3e-4]], **F64)
    mu = torch.tensor([[-0.1, 0.2, -0.3]], **F64)  # log-mismatch mean 0.0667: ρ inside the band
    adv = torch.tensor([1.0], **F64)
    zeros = torch.zeros_like(d)
    mask = torch.ones_like(d, dtype=torch.bool)
    short, ms = LOSSES[name](d, zeros, mu, adv, mask)
    long, ml = LOSSES[name](_doubled(d), _doubled(zeros), _doubled(mu), adv, _doubled(mask))
    assert long.item() == pytest.approx(short.item(), abs=1e-14)
    for key in ("seq_ratio_mean",) + (("mismatch_ratio_mean",) if name == "tbpo" else ()):
        assert ml[key].item() == pytest.approx(ms[key].item(), abs=1e-14)


def test_product_form_sequence_ratio_is_not_length_safe():
    """The product-form sequence ratio squares when every token is repeated
    (Π r_t over twice the tokens), while the geometric form stays put."""
    old = torch.tensor([[0.01, -0.02, 0.03]], **F64)
    mu = torch.zeros_like(old)
    mask = torch.ones_like(old, dtype=torch.bool)
    prod = CORRECTIONS["tis_seq"](old, mu, mask, form="product", cap=100.0)
    prod2 = CORRECTIONS["tis_seq"](
        _doubled(old), _doubled(mu), _doubled(mask), form="product", cap=100.0
    )
    # corrections compute in float32: 1e-6 relative is float32 rounding of a number near 1
    assert prod.metrics["ratio_mean"].item() == pytest.approx(math.exp(0.02), rel=1e-6)
    assert prod2.metrics["ratio_mean"].item() == pytest.approx(math.exp(0.04), rel=1e-6)
    geo = CORRECTIONS["tis_seq"](old, mu, mask)
    geo2 = CORRECTIONS["tis_seq"](_doubled(old), _doubled(mu), _doubled(mask))
    geo_ratio = geo.metrics["ratio_mean"].item()
    assert geo2.metrics["ratio_mean"].item() == pytest.approx(geo_ratio, rel=1e-6)


def test_tbpo_nan_mismatch_is_dropped_without_poisoning_gradients():
    """A sequence whose sampler logprobs are NaN has ρ = NaN: it falls outside the band and
    the other sequences' loss and gradients stay finite (its own gradient is exactly 0)."""
    logp, old, mu, adv, mask = _rows([[1e-4, 1e-4], [1e-4, 1e-4]], [1.0, 1.0])
    mu[0, 0] = float("nan")
    loss, m = LOSSES["tbpo"](logp, old, mu, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(-math.exp(1e-4), abs=1e-12)
    assert torch.equal(logp.grad[0], torch.zeros(2, **F64))
    assert torch.isfinite(logp.grad).all() and m["band_drop_frac"].item() == 0.5


@pytest.mark.parametrize("name", ["gspo", "tbpo"])
def test_token_weights_act_on_a_sequence_loss_as_their_row_mean(name):
    """A token-level correction's weights (e.g. tis_token) on a sequence loss, default
    seq-mean-token-mean aggregation: the loss and its gradient equal those with each row's
    weights replaced by their mean over the row's tokens (the documented choice)."""
    g = torch.Generator().manual_seed(3)
    N, L = 4, 6
    old = -torch.rand(N, L, generator=g) * 2
    logp = (old + 1e-4 * torch.randn(N, L, generator=g)).requires_grad_()
    mask = torch.ones(N, L, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    weights = torch.rand(N, L, generator=g) * 2 * mask  # [N, L], 0 off-mask
    row_mean = (weights.sum(1) / mask.sum(1))[:, None].expand(N, L) * mask
    grads = []
    for w in (weights, row_mean):
        loss, _ = LOSSES[name](logp, old, old, adv, mask, is_weights=w)
        grads.append(torch.autograd.grad(loss, logp)[0])
        grads.append(loss.detach())
    assert torch.allclose(grads[1], grads[3], rtol=1e-6, atol=0)
    assert torch.allclose(grads[0], grads[2], rtol=1e-5, atol=1e-9)
