"""The KL to the reference policy as the trainer uses it: in the reward (a per-response
penalty before the advantages) and the reference itself (a frozen copy of the learner)."""

from __future__ import annotations

import math

import pytest
import torch

from qarl.config import AlgoSection
from qarl.train.learner.reference import Reference, weights_digest
from qarl.train.phases import compute_advantages, reference_kl
from qarl.types import RolloutBatch


def _batch(lengths: list[int], L: int = 3) -> RolloutBatch:
    N = len(lengths)
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    return RolloutBatch(prompt_ids=torch.ones(N, 1, dtype=torch.long),
                        prompt_mask=torch.ones(N, 1, dtype=torch.bool),
                        response_ids=torch.ones(N, L, dtype=torch.long), response_mask=mask,
                        rollout_logp=torch.zeros(N, L))


def test_kl_in_the_reward_is_subtracted_per_response_before_the_advantages():
    """k1 per token d = old - ref; rows of lengths 2, 1, 3, 2 with d = 0.5 on every real
    token have KL sums 1.0, 0.5, 1.5, 1.0; with kl_coef 0.2 the rewards 1, 1, 0, 0 become
    0.8, 0.9, -0.3, -0.2, and Dr.GRPO advantages (group 2) are r - group mean."""
    batch = _batch([2, 1, 3, 2])
    old = torch.where(batch.response_mask, torch.tensor(-1.0), torch.tensor(0.0))
    ref = torch.where(batch.response_mask, torch.tensor(-1.5), torch.tensor(0.0))
    algo = AlgoSection(kl_coef=0.2, kl_estimator="k1", kl_in="reward", advantage="dr_grpo")
    penalty, metrics = reference_kl(algo, old, ref, batch.response_mask)
    assert penalty.tolist() == pytest.approx([0.2, 0.1, 0.3, 0.2], abs=1e-12)
    assert metrics["kl/token_mean"] == pytest.approx(0.5)
    assert metrics["kl/seq_sum_mean"] == pytest.approx(1.0)
    adv, _, _ = compute_advantages([1.0, 1.0, 0.0, None], batch, algo, 2, penalty)
    # group 1: 0.8, 0.9 -> mean 0.85; group 2: -0.3 and an unscorable reward -> 0
    assert adv.tolist() == pytest.approx([-0.05, 0.05, 0.0, 0.0], abs=1e-6)


def test_kl_in_the_loss_gives_no_penalty():
    batch = _batch([2, 2])
    algo = AlgoSection(kl_coef=0.2, kl_estimator="k3", kl_in="loss")
    old = torch.full((2, 3), -1.0)
    ref = torch.full((2, 3), -2.0)
    penalty, metrics = reference_kl(algo, old, ref, batch.response_mask)
    assert penalty is None
    # k3 at d = 1: exp(-1) + 1 - 1
    assert metrics["kl/token_mean"] == pytest.approx(math.exp(-1.0), rel=1e-6)


class _Scorer:
    def __init__(self, model):
        self.model = model

    def score_routing(self, batch, sampling, replay=False):
        return torch.full(batch.response_mask.shape, -1.0), None

    def release_caches(self):
        pass


def test_the_reference_is_a_frozen_copy_whose_digest_names_its_weights():
    """Reference.of copies the model (later updates of the learner leave it alone), takes
    no gradient, and its digest changes with any weight."""
    learner = torch.nn.Linear(4, 3)
    ref = Reference.of(learner, _Scorer)
    assert ref.model is not learner and not any(p.requires_grad for p in ref.model.parameters())
    assert ref.digest == weights_digest(learner)
    with torch.no_grad():
        learner.weight[0, 0] += 1.0
    assert weights_digest(learner) != ref.digest and ref.digest == weights_digest(ref.model)
    assert ref.logp(_batch([1]), None).shape == (1, 3)
