"""Advantage estimators and DAPO overlong shaping against hand-computed values."""

import math

import pytest
import torch

from qarl.algo import ADVANTAGE_MODES, LOSSES, UnknownNameError, group_advantages, overlong_penalty

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
    with pytest.raises(UnknownNameError, match="dr_grpo, grpo, reinforce_pp, "
                       "reinforce_pp_baseline, rloo"):
        group_advantages([1.0, 0.0], 2, mode="ppo")
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


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
def test_all_unscorable_group_gets_zero_advantage(mode):
    """A group whose rewards are all None (every call failed or was unscorable) gets
    advantages exactly 0, never NaN, and does not disturb the other group."""
    adv, info = group_advantages([None] * 4 + [1.0, 0.0, 0.0, 0.0], group_size=4, mode=mode,
                                 lengths=[2] * 8)
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


def test_rloo_leave_one_out_baseline():
    """Group [1, 0, None, 0.5]: scorable [1, 0, 0.5]; A_i = r_i − mean of the other two:
    1 − 0.25 = 0.75, 0 − 0.75 = −0.75, 0 (None), 0.5 − 0.5 = 0. Group [1, 1, 1, 1] and group
    [None, 1, None, None] (one scorable sample: no one to leave out) get 0."""
    rewards = [1.0, 0.0, None, 0.5] + [1.0] * 4 + [None, 1.0, None, None]
    adv, info = group_advantages(rewards, group_size=4, mode="rloo")
    assert adv.tolist() == [0.75, -0.75, 0.0, 0.0] + [0.0] * 8
    assert info.all_equal.tolist() == [False, True, True]


def test_rloo_is_dr_grpo_scaled_by_n_over_n_minus_1():
    """RLOO = n/(n − 1)·(r − mean_g) with n the group's scorable count (3 here, then 4)."""
    rewards = [0.3, None, 0.9, 0.1, 0.2, 0.8, 0.4, 0.7]
    rloo, _ = group_advantages(rewards, group_size=4, mode="rloo")
    dr, _ = group_advantages(rewards, group_size=4, mode="dr_grpo")
    scale = torch.tensor([1.5] * 4 + [4 / 3] * 4)
    torch.testing.assert_close(rloo, dr * scale, rtol=1e-6, atol=0)


# rewards [1, 0 | 0, 1 | 1, 1] (group 2), response lengths [3, 1 | 2, 2 | 1, 1]; T = 10 tokens
PP_REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
PP_LENGTHS = [3, 1, 2, 2, 1, 1]


def test_reinforce_pp_whitens_over_the_batch_tokens():
    """μ = (3 + 2 + 1 + 1)/10 = 0.7; σ² = Σ L·(r − μ)² / (T − 1) = (6·0.09 + 3·0.49)/9 = 7/30
    (verl's unbiased masked_var over tokens); A = (r − 0.7)/sqrt(7/30 + 1e-8). The all-equal
    group [1, 1] keeps its advantage: it is above the batch mean."""
    adv, info = group_advantages(PP_REWARDS, 2, mode="reinforce_pp", lengths=PP_LENGTHS)
    s = math.sqrt(7 / 30 + 1e-8)
    hi, lo = 0.3 / s, -0.7 / s  # 0.62106, −1.44914
    want = torch.tensor([hi, lo, lo, hi, hi, hi])
    torch.testing.assert_close(adv, want, rtol=1e-6, atol=0)
    assert info.all_equal.tolist() == [False, False, True]
    assert info.keep.tolist() == [True] * 4 + [False] * 2


def test_reinforce_pp_drop_all_equal_leaves_the_group_out_of_the_statistics():
    """With drop_all_equal (dynamic sampling) the batch is the first two groups, T = 8:
    μ = 5/8, σ² = (3·9 + 25 + 2·25 + 2·9)/64 / 7 = 15/56; the dropped group gets 0."""
    adv, _ = group_advantages(PP_REWARDS, 2, mode="reinforce_pp", lengths=PP_LENGTHS,
                              drop_all_equal=True)
    s = math.sqrt(15 / 56 + 1e-8)
    hi, lo = (3 / 8) / s, (-5 / 8) / s  # 0.72457, −1.20761
    want = torch.tensor([hi, lo, lo, hi, 0.0, 0.0])
    torch.testing.assert_close(adv, want, rtol=1e-6, atol=0)


def test_reinforce_pp_baseline_centers_in_the_group_then_whitens_the_batch():
    """Rewards [1, 0 | 2, 0 | 1, 1], lengths [3, 1 | 1, 3 | 2, 2]: group-centered v =
    [0.5, −0.5, 1, −1] (the all-equal group is 0 and out of the statistics). verl's
    masked_whiten re-centers: μ = (1.5 − 0.5 + 1 − 3)/8 = −1/8, so v − μ = [5, −3, 9, −7]/8;
    σ² = (3·25 + 9 + 81 + 3·49)/64 / 7 = 39/56; A = (v − μ)/sqrt(39/56 + 1e-8)."""
    adv, info = group_advantages([1.0, 0.0, 2.0, 0.0, 1.0, 1.0], 2,
                                 mode="reinforce_pp_baseline", lengths=[3, 1, 1, 3, 2, 2])
    s = math.sqrt(39 / 56 + 1e-8)
    want = torch.tensor([5 / 8 / s, -3 / 8 / s, 9 / 8 / s, -7 / 8 / s, 0.0, 0.0])
    torch.testing.assert_close(adv, want, rtol=1e-6, atol=0)
    assert info.all_equal.tolist() == [False, False, True]


def test_reinforce_pp_unscorable_and_empty_responses_are_left_out():
    """Rewards [1, None | 0, 1], lengths [2, 5 | 1, 1]: the None (5 tokens) is not counted;
    T = 4, μ = 3/4, σ² = (2/16 + 9/16 + 1/16)/3 = 1/4, A = [0.5, 0, −1.5, 0.5]. Rewards
    [1, 0 | 0, 1] with lengths [0, 2 | 1, 1]: the empty response has no token to count or to
    train: 0; the others μ = 1/4, σ² = 1/4, A = [0, −0.5, −0.5, 1.5]."""
    s = math.sqrt(0.25 + 1e-8) / 0.5
    adv, info = group_advantages([1.0, None, 0.0, 1.0], 2, mode="reinforce_pp",
                                 lengths=[2, 5, 1, 1])
    torch.testing.assert_close(adv, torch.tensor([0.5, 0.0, -1.5, 0.5]) / s, rtol=1e-6, atol=0)
    assert info.all_equal.tolist() == [True, False]
    adv, _ = group_advantages([1.0, 0.0, 0.0, 1.0], 2, mode="reinforce_pp", lengths=[0, 2, 1, 1])
    torch.testing.assert_close(adv, torch.tensor([0.0, -0.5, -0.5, 1.5]) / s, rtol=1e-6, atol=0)


def _verl_masked_whiten(values, mask):
    """verl's torch_functional.masked_whiten (shift_mean=True), transcribed: masked_mean with
    its 1e-8 on the count, masked_var with the unbiased correction, rsqrt(var + 1e-8)."""
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = ((values - mean) ** 2 * mask).sum() / (mask.sum() + 1e-8)
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


@pytest.mark.parametrize("mode", ["reinforce_pp", "reinforce_pp_baseline"])
def test_batch_modes_equal_verl_token_level_whitening(mode):
    """Continuous rewards (no all-equal group), lengths 1..6: the advantage of each row equals
    verl's masked_whiten of the reward (group-centered for the baseline) repeated on the row's
    response tokens, to float32 rounding (verl's 1e-8 on the token count is far below it)."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=g, dtype=torch.float64)  # [12], 3 groups of 4
    lengths = torch.randint(1, 7, (12,), generator=g)  # [12]
    mask = (torch.arange(6)[None, :] < lengths[:, None]).double()  # [12, 6]
    group_mean = rewards.view(3, 4).mean(1).repeat_interleave(4)  # [12]
    v = rewards if mode == "reinforce_pp" else rewards - group_mean
    want = _verl_masked_whiten(v[:, None] * mask, mask)[:, 0]  # every token of a row is equal
    adv, _ = group_advantages(rewards, 4, mode=mode, lengths=lengths)
    torch.testing.assert_close(adv.double(), want, rtol=1e-6, atol=1e-7)


def test_batch_modes_need_lengths():
    """reinforce_pp without lengths says what to pass; lengths of the wrong shape are refused."""
    with pytest.raises(ValueError, match="pass lengths"):
        group_advantages([1.0, 0.0], 2, mode="reinforce_pp")
    with pytest.raises(ValueError, match="lengths must be"):
        group_advantages([1.0, 0.0], 2, mode="reinforce_pp_baseline", lengths=[3])


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_every_mode_trains_with_every_loss(mode, loss_name):
    """Advantages of each mode (rewards [1, 0 | 0, 1 | None, 1], lengths [3, 1 | 2, 2 | 2, 3])
    fed to each loss on a float32 batch: a finite loss and a finite, nonzero gradient."""
    lengths = torch.tensor([3, 1, 2, 2, 2, 3])
    adv, _ = group_advantages([1.0, 0.0, 0.0, 1.0, None, 1.0], 2, mode=mode, lengths=lengths)
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(3)[None, :] < lengths[:, None]  # [6, 3]
    old = -torch.rand(6, 3, generator=g) * 2  # [6, 3] float32
    logp = (old + (torch.rand(6, 3, generator=g) - 0.5) * 1e-4).requires_grad_(True)
    loss, _ = LOSSES[loss_name](logp, old, old.clone(), adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad.abs().sum() > 0
