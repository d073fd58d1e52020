"""Group advantages and DAPO overlong shaping against hand-computed values."""

import math

import pytest
import torch

from qarl.algo import UnknownNameError, group_advantages, overlong_penalty

# group 0: [1, 0, None, 1] -> scorable [1, 0, 1], mean 2/3, unbiased var (1/9+4/9+1/9)/2 = 1/3
# group 1: [1, 1, 1, None] -> all equal
REWARDS = [1.0, 0.0, None, 1.0, 1.0, 1.0, 1.0, None]


def test_grpo_mean_and_std():
    """A = (r − 2/3) / sqrt(1/3): [1/√3, −2/√3, 0 (None), 1/√3]; group 1 all zeros."""
    adv, info = group_advantages(REWARDS, group_size=4, eps=0.0)
    s = 1 / math.sqrt(3)
    expected = torch.tensor([(1 / 3) / s, (-2 / 3) / s, 0, (1 / 3) / s, 0, 0, 0, 0])
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)
    assert info.all_equal.tolist() == [False, True]
    assert info.scorable.tolist() == [True, True, False, True, True, True, True, False]
    assert info.keep.tolist() == [True] * 4 + [False] * 4
    assert info.mean[0].item() == pytest.approx(2 / 3) and info.std[0].item() == pytest.approx(s)


def test_dr_grpo_mean_only():
    """Dr.GRPO: A = r − 2/3 = [1/3, −2/3, 0, 1/3], no std scaling."""
    adv, _ = group_advantages(REWARDS, group_size=4, mode="dr_grpo")
    torch.testing.assert_close(adv[:4], torch.tensor([1 / 3, -2 / 3, 0.0, 1 / 3]))


def test_nan_tensor_equals_none_list():
    """A tensor with NaN for unscorable samples gives the same result as a list with None."""
    t = torch.tensor([math.nan if r is None else r for r in REWARDS])
    a_list, _ = group_advantages(REWARDS, 4)
    a_tensor, _ = group_advantages(t, 4)
    assert torch.equal(a_list, a_tensor)


def test_single_scorable_sample_is_all_equal():
    """A group with one scorable reward has no spread: marked all_equal, advantages 0."""
    adv, info = group_advantages([None, 1.0, None], group_size=3)
    assert info.all_equal.tolist() == [True] and torch.equal(adv, torch.zeros(3))


def test_bad_arguments_raise():
    """Unknown mode lists the valid ones; a group size that does not divide N raises."""
    with pytest.raises(UnknownNameError, match="dr_grpo, grpo"):
        group_advantages([1.0, 0.0], 2, mode="rloo")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages([1.0, 0.0, 1.0], 2)


def test_overlong_penalty_zones():
    """L_max = 10, L_cache = 4 (soft zone 6 < L ≤ 10): L = 5, 6 -> 0; 8 -> (6 − 8)/4 = −0.5;
    10 -> −1; 11 -> −1. With L_cache = 0 the penalty is a hard −1 past L_max."""
    out = overlong_penalty(torch.tensor([5, 6, 8, 10, 11]), l_max=10, l_cache=4)
    assert out.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty([10, 11], l_max=10, l_cache=0).tolist() == [0.0, -1.0]
    with pytest.raises(ValueError, match="l_cache"):
        overlong_penalty([1], l_max=4, l_cache=5)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
def test_all_unscorable_group_gets_zero_advantage(mode):
    """A group whose rewards are all None (every call failed or was unscorable) gets
    advantages exactly 0, never NaN, and does not disturb the other group."""
    adv, info = group_advantages([None] * 4 + [1.0, 0.0, 0.0, 0.0], group_size=4, mode=mode)
    assert torch.equal(adv[:4], torch.zeros(4)) and not adv.isnan().any()
    assert info.all_equal.tolist() == [True, False] and info.mean[0].item() == 0.0


def test_group_statistics_are_float64():
    """Close continuous rewards keep their spread: the advantages of [10, 10.001, 10.0005,
    9.9995] equal the float64 formula to float32 rounding (float32 statistics were 7e-4 off
    relative: 1.16091 for 1.16010), for a list and for a float32 tensor alike."""
    rewards = [10.0, 10.001, 10.0005, 9.9995]
    r = torch.tensor(rewards, dtype=torch.float64)
    want = (r - r.mean()) / (r.std() + 1e-6)  # [4] float64
    for given in (rewards, torch.tensor(rewards, dtype=torch.float64)):
        adv, info = group_advantages(given, 4)
        assert adv.dtype == torch.float32 and info.mean.dtype == torch.float64
        assert float(((adv.double() - want) / want).abs().max()) < 1e-7, adv
