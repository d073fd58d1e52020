"""Token-level PPO losses (grpo, dr_grpo, dapo, dual_clip) against hand-computed values.

Inputs are built so that the token ratio r = exp(logp − old_logp) takes chosen values:
old_logp = 0 and logp = log r. Everything runs in float64 so hand values match to 1e-12.
"""

import math

import pytest
import torch

from qarl.algo import LOSSES


def _inputs(ratios, advantages, lengths=None):
    """logp [N, L] with grad (= log r), old_logp = rollout_logp = 0, advantages [N], mask."""
    r = torch.tensor(ratios, dtype=torch.float64)
    logp = torch.log(r).requires_grad_(True)
    zeros = torch.zeros_like(r)
    adv = torch.tensor(advantages, dtype=torch.float64)
    if lengths is None:
        mask = torch.ones_like(r, dtype=torch.bool)
    else:
        mask = torch.arange(r.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    return logp, zeros, zeros.clone(), adv, mask


def test_grpo_positive_advantage_branches():
    """A = +1, r = [1.1, 1.5, 0.5, 1.0], ε = 0.2: ℓ = −min(r, clip(r, 0.8, 1.2)) =
    [−1.1, −1.2 (clipped above), −0.5 (below: min keeps r), −1.0]; mean −0.95.
    Gradient dℓ/dlogp = −r/4 except the clipped token, which gets exactly 0."""
    logp, old, mu, adv, mask = _inputs([[1.1, 1.5, 0.5, 1.0]], [1.0])
    loss, m = LOSSES["grpo"](logp, old, mu, adv, mask)
    assert loss.item() == pytest.approx(-0.95, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[-1.1 / 4, 0.0, -0.5 / 4, -1.0 / 4]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)
    assert logp.grad[0, 1].item() == 0.0
    assert m["clip_frac_pos"].item() == pytest.approx(0.25)
    assert m["clip_frac_neg"].item() == 0.0


def test_grpo_negative_advantage_branches():
    """A = −1, same ratios: ℓ = max(r, clip(r, 0.8, 1.2)) = [1.1, 1.5 (above: no clip for
    A < 0), 0.8 (clipped below), 1.0]; mean 1.1; the clipped token has zero gradient."""
    logp, old, mu, adv, mask = _inputs([[1.1, 1.5, 0.5, 1.0]], [-1.0])
    loss, m = LOSSES["grpo"](logp, old, mu, adv, mask)
    assert loss.item() == pytest.approx(1.1, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[1.1 / 4, 1.5 / 4, 0.0, 1.0 / 4]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)
    assert m["clip_frac_neg"].item() == pytest.approx(0.25)
    assert m["clip_frac_pos"].item() == 0.0


def test_grpo_seq_mean_token_mean_over_rows():
    """Two rows of lengths 4 and 2: the loss is the mean of the per-row token means,
    (−0.95 + (1.1 + 1.5)/2) / 2, not the mean over the 6 tokens."""
    logp, old, mu, adv, mask = _inputs(
        [[1.1, 1.5, 0.5, 1.0], [1.1, 1.5, 1.0, 1.0]], [1.0, -1.0], lengths=[4, 2]
    )
    loss, _ = LOSSES["grpo"](logp, old, mu, adv, mask)
    assert loss.item() == pytest.approx((-0.95 + 1.3) / 2, abs=1e-12)


def _dapo_rows():
    # Row 0 (A = +1): r = [1.25, 1.3, 0.7]; row 1 (A = −1): r = [0.75, 0.85], one pad slot.
    return _inputs([[1.25, 1.3, 0.7], [0.75, 0.85, 1.0]], [1.0, -1.0], lengths=[3, 2])


def test_dapo_clip_higher_token_mean():
    """ε_l = 0.2, ε_h = 0.28: row 0 ℓ = [−1.25 (inside: clip-higher lets it through),
    −1.28 (clipped), −0.7]; row 1 ℓ = [0.8 (clipped below), 0.85]; token mean over the
    5 tokens = −1.58 / 5. Clip fractions: 1/3 of positive tokens, 1/2 of negative ones."""
    logp, old, mu, adv, mask = _dapo_rows()
    loss, m = LOSSES["dapo"](logp, old, mu, adv, mask)
    assert loss.item() == pytest.approx(-1.58 / 5, abs=1e-12)
    assert m["clip_frac_pos"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_neg"].item() == pytest.approx(1 / 2)
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    loss.backward()
    expected = torch.tensor([[-1.25, 0.0, -0.7], [0.0, 0.85, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)


def test_dr_grpo_sums_tokens_over_a_constant():
    """Dr.GRPO with ε = 0.2 on the DAPO rows: ℓ = [−1.2 (1.25 clipped at 1.2), −1.2, −0.7]
    and [0.8, 0.85]; sum −1.45 divided by S · norm_len = 2 · 4."""
    logp, old, mu, adv, mask = _dapo_rows()
    loss, _ = LOSSES["dr_grpo"](logp, old, mu, adv, mask, norm_len=4)
    assert loss.item() == pytest.approx(-1.45 / 8, abs=1e-12)


def test_dual_clip_caps_negative_advantages():
    """c = 3, A = −2, r = [4, 2, 0.5]: PPO gives 2·max(r, clip(r)) = [8, 4, 1.6]; the dual
    clip caps at −c·A = 6: ℓ = [6, 4, 1.6]. Gradient 0 for the dual-clipped and the
    ordinarily clipped token; 2·r/3 = 4/3 for the middle one."""
    logp, old, mu, adv, mask = _inputs([[4.0, 2.0, 0.5]], [-2.0])
    loss, m = LOSSES["dual_clip"](logp, old, mu, adv, mask)
    assert loss.item() == pytest.approx((6 + 4 + 1.6) / 3, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.0, 4 / 3, 0.0]], dtype=torch.float64), rtol=0, atol=1e-12
    )
    assert m["dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_neg"].item() == pytest.approx(2 / 3)


def test_dual_clip_leaves_positive_advantages_alone():
    """For A > 0 dual clip equals GRPO: r = 4 gives −min(4, 1.2) = −1.2 in both."""
    logp, old, mu, adv, mask = _inputs([[4.0, 1.0]], [1.0])
    dual, _ = LOSSES["dual_clip"](logp, old, mu, adv, mask)
    grpo, _ = LOSSES["grpo"](logp, old, mu, adv, mask)
    assert dual.item() == grpo.item() == pytest.approx((-1.2 - 1.0) / 2, abs=1e-12)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "dual_clip"])
def test_is_weights_scale_tokens_without_gradient(name):
    """is_weights multiply the per-token loss: weight 0 removes a token's gradient, weight 2
    doubles it, and the weights themselves receive no gradient."""
    logp, old, mu, adv, mask = _inputs([[1.0, 1.0]], [1.0])
    weights = torch.tensor([[0.0, 2.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = LOSSES[name](logp, old, mu, adv, mask, is_weights=weights)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() < 0.0
    assert weights.grad is None


def test_padding_with_minus_inf_stays_finite():
    """Padding positions holding −inf logprobs give a finite loss and finite gradients."""
    logp, old, mu, adv, mask = _inputs([[1.1, 1.0]], [1.0], lengths=[1])
    padded = torch.where(mask, logp, torch.tensor(-math.inf, dtype=torch.float64))
    loss, m = LOSSES["grpo"](padded, old, mu, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert loss.item() == pytest.approx(-1.1, abs=1e-12)
