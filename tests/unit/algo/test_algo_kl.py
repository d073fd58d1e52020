"""KL estimators (verl's kl_penalty) against hand-computed values, masks and gradients.

logp = [−1, −2, −0.5], ref_logp = [−1.5, −1, −0.5], so d = logp − ref_logp = [0.5, −1, 0].
Everything runs in float64 so hand values match to 1e-12.
"""

import math

import pytest
import torch

from qarl.algo import KL_ESTIMATORS, UnknownNameError, kl_terms


def _inputs():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    return logp, ref


# estimator -> (value, d value / d logp) per token, by hand from d = [0.5, −1, 0]
HAND = {
    "k1": ([0.5, -1.0, 0.0], [1.0, 1.0, 1.0]),
    "abs": ([0.5, 1.0, 0.0], [1.0, -1.0, 0.0]),  # d|d|/dd = sign(d), 0 at d = 0
    "k2": ([0.125, 0.5, 0.0], [0.5, -1.0, 0.0]),  # ½d², gradient d
    # exp(−d) + d − 1: e^−0.5 − 0.5, e − 2, 0; gradient 1 − exp(−d): 1 − e^−0.5, 1 − e, 0
    "k3": ([math.exp(-0.5) - 0.5, math.e - 2.0, 0.0],
           [1.0 - math.exp(-0.5), 1.0 - math.e, 0.0]),
}


@pytest.mark.parametrize("name", KL_ESTIMATORS)
def test_values_and_gradients_by_hand(name):
    """Each estimator's per-token value and its gradient with respect to logp (k3's is
    1 − exp(ref_logp − logp), the low-variance form) match the hand values."""
    logp, ref = _inputs()
    out = kl_terms(logp, ref, estimator=name)
    value, grad = HAND[name]
    torch.testing.assert_close(out, torch.tensor([value], dtype=torch.float64), rtol=0,
                               atol=1e-12)
    out.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([grad], dtype=torch.float64), rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize("name", KL_ESTIMATORS)
def test_masked_positions_are_zero_even_over_minus_inf(name):
    """A masked position is 0 and has gradient exactly 0, even where padding holds −inf;
    a 0/1 float mask acts as the bool one."""
    for mask in (torch.tensor([[True, True, False]]), torch.tensor([[1.0, 1.0, 0.0]])):
        logp, ref = _inputs()
        padded = torch.where(mask > 0, logp, torch.tensor(-math.inf, dtype=torch.float64))
        out = kl_terms(padded, ref, mask, estimator=name)
        assert out[0, 2].item() == 0.0
        torch.testing.assert_close(out[0, :2], torch.tensor(HAND[name][0][:2],
                                                             dtype=torch.float64))
        out.sum().backward()
        assert torch.isfinite(logp.grad).all() and logp.grad[0, 2].item() == 0.0


def test_k3_is_clamped_like_verl():
    """verl clamps ref_logp − logp to ±20 and k3 to ±10: d = −30 (exp(20) − 21) and
    d = +30 (e^−20 + 19) both give 10 with gradient 0; d = −2.6 (e^2.6 − 3.6 = 9.86) is
    below the bound and keeps its gradient 1 − e^2.6."""
    logp = torch.tensor([[-30.0, 30.0, -2.6]], dtype=torch.float64, requires_grad=True)
    out = kl_terms(logp, torch.zeros_like(logp), estimator="k3")
    torch.testing.assert_close(
        out, torch.tensor([[10.0, 10.0, math.exp(2.6) - 3.6]], dtype=torch.float64),
        rtol=0, atol=1e-12)
    out.sum().backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.0, 0.0, 1.0 - math.exp(2.6)]], dtype=torch.float64),
        rtol=0, atol=1e-12)


def test_unknown_name_and_shapes_raise():
    """An unknown name lists the valid ones (and maps verl's name); shapes must agree."""
    logp, ref = _inputs()
    with pytest.raises(UnknownNameError, match=r"verl's 'low_var_kl' is 'k3'.*abs, k1, k2, k3"):
        kl_terms(logp, ref, estimator="low_var_kl")
    with pytest.raises(UnknownNameError, match="abs, k1, k2, k3"):
        kl_terms(logp, ref, estimator="k4")
    with pytest.raises(ValueError, match="one shape"):
        kl_terms(logp, ref[:, :2], estimator="k1")
