"""ReplayAudit: old_logp as the sampler's logprobs where the replay is exact by construction,
checked on audited rows; any difference replays the step whole and every later one."""

from __future__ import annotations

import torch

from qarl.train.learner.audit import ReplayAudit, audited_rows
from qarl.types import RolloutBatch, SamplingParams

N, P, L = 16, 3, 5
SAMPLING = SamplingParams(max_new_tokens=L)


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, L + 1, (N,), generator=g)
    mask = torch.arange(L)[None, :] < lengths[:, None]
    logp = -torch.rand(N, L, generator=g) * mask
    return RolloutBatch(torch.zeros(N, P, dtype=torch.long), torch.ones(N, P, dtype=torch.bool),
                        torch.randint(0, 50, (N, L), generator=g), mask, logp,
                        ["stop"] * N)


class ReplayingLearner:
    """A learner whose replay returns each row's sampler logprobs (what an exact replay
    does) plus `shift` on the rows of `bad`; it records the rows it was asked to replay."""

    def __init__(self, full: RolloutBatch, bad: tuple[int, ...] = (), shift: float = 0.0,
                 only_in_part: bool = False):
        self.full, self.bad, self.shift, self.calls = full, bad, shift, []
        self.only_in_part = only_in_part  # the shift only where fewer than all rows replay

    def replay(self, batch: RolloutBatch, sampling: SamplingParams, for_update: bool = False):
        rows = [next(i for i in range(N) if torch.equal(self.full.response_ids[i], r))
                for r in batch.response_ids]
        self.calls.append(rows)
        logp = self.full.rollout_logp[rows].clone()
        for j, i in enumerate(rows):
            if i in self.bad and not (self.only_in_part and len(rows) == N):
                logp[j] += self.shift * batch.response_mask[j]
        assert batch.prompt_ids.shape[1] == P and batch.response_ids.shape[1] == L
        return logp, None


def test_an_exact_step_replays_only_its_audited_rows_in_the_batch_shape():
    batch = _batch()
    learner = ReplayingLearner(batch)
    audit = ReplayAudit(exact=True, fraction=0.125, full_every=8)
    old = audit.old_logp(learner, batch, SAMPLING, seed=3, step=1)
    expected_rows = audited_rows(N, 0.125, 3, 1)
    assert learner.calls == [expected_rows.tolist()] and len(expected_rows) == 2
    assert old.logp is batch.rollout_logp and torch.equal(old.replayed_rows, expected_rows)
    assert old.metrics == {"audit/replayed_frac": 2 / N, "audit/failed": 0.0,
                           "audit/full_replay": 0.0, "audit/abs_diff_max": 0.0,
                           "audit/batch_shape_diff": 0.0, "audit/stale": 0.0}


def test_the_whole_batch_is_replayed_every_full_every_steps_and_checked():
    batch = _batch()
    learner = ReplayingLearner(batch)
    audit = ReplayAudit(exact=True, fraction=0.125, full_every=4)
    for step in (0, 4, 8):
        old = audit.old_logp(learner, batch, SAMPLING, seed=0, step=step)
        assert old.metrics["audit/replayed_frac"] == 1.0
        assert old.metrics["audit/abs_diff_max"] == 0.0
    assert learner.calls == [list(range(N))] * 3


def test_one_bit_of_difference_on_an_audited_row_replays_the_step_and_every_later_one():
    """The smallest planted difference (one float32 ulp on one row) is found: that step's
    old_logp is the learner's full replay, the alert names the step and the size, and from
    then on every step replays whole (full_replay, which a resumed run restores)."""
    batch = _batch()
    rows = audited_rows(N, 0.125, 0, 1)
    bad = int(rows[0])
    learner = ReplayingLearner(batch, bad=(bad,), shift=1e-7)
    audit = ReplayAudit(exact=True, fraction=0.125, full_every=0)
    old = audit.old_logp(learner, batch, SAMPLING, seed=0, step=1)
    assert learner.calls == [rows.tolist(), list(range(N))]
    assert old.metrics["audit/failed"] == 1.0 and old.metrics["audit/full_replay"] == 1.0
    assert 0 < old.metrics["audit/abs_diff_max"] < 1e-6
    assert not torch.equal(old.logp[bad], batch.rollout_logp[bad])  # the learner's replay
    assert audit.full_replay and audit.alert.startswith("step 2: the replay audit found")
    later = audit.old_logp(learner, batch, SAMPLING, seed=0, step=2)
    assert learner.calls[-1] == list(range(N)) and later.metrics["audit/failed"] == 0.0
    assert later.metrics["audit/full_replay"] == 1.0 and "audit/abs_diff_max" not in later.metrics


def test_a_difference_only_in_the_audited_rows_smaller_batch_is_no_alert():
    """Audited rows that differ where the whole batch, replayed in its sampled shape, equals
    the sampler bit for bit: a batch-shape effect of the subset replay, not a stale policy.
    The step keeps the sampler's logprobs, records the difference, and the audits go on."""
    batch = _batch()
    rows = audited_rows(N, 0.125, 0, 1)
    learner = ReplayingLearner(batch, bad=(int(rows[0]),), shift=2e-6, only_in_part=True)
    audit = ReplayAudit(exact=True, fraction=0.125, full_every=0)
    old = audit.old_logp(learner, batch, SAMPLING, seed=0, step=1)
    assert learner.calls == [rows.tolist(), list(range(N))]
    assert torch.equal(old.logp, batch.rollout_logp) and not audit.full_replay
    assert old.metrics["audit/failed"] == 0.0 and old.metrics["audit/abs_diff_max"] == 0.0
    assert 1e-6 < old.metrics["audit/batch_shape_diff"] < 3e-6
    later = audit.old_logp(learner, batch, SAMPLING, seed=0, step=2)
    assert len(learner.calls[-1]) == 2 and later.metrics["audit/full_replay"] == 0.0


def test_a_difference_on_rows_the_audit_does_not_draw_goes_unseen_until_a_full_step():
    """What the audit costs in coverage: a row it did not draw is not checked that step; the
    periodic whole-batch replay checks it."""
    batch = _batch()
    drawn = set(audited_rows(N, 0.125, 0, 1).tolist())
    bad = next(i for i in range(N) if i not in drawn)
    learner = ReplayingLearner(batch, bad=(bad,), shift=0.5)
    audit = ReplayAudit(exact=True, fraction=0.125, full_every=2)
    assert audit.old_logp(learner, batch, SAMPLING, seed=0, step=1).metrics["audit/failed"] == 0
    assert audit.old_logp(learner, batch, SAMPLING, seed=0, step=2).metrics["audit/failed"] == 1


def test_alignments_whose_replay_differs_by_design_always_replay_whole():
    batch = _batch()
    learner = ReplayingLearner(batch, bad=tuple(range(N)), shift=0.25)
    audit = ReplayAudit(exact=False, fraction=0.125, full_every=8)
    old = audit.old_logp(learner, batch, SAMPLING, seed=0, step=1)
    assert learner.calls == [list(range(N))] and not audit.full_replay
    assert torch.allclose(old.logp, batch.rollout_logp + 0.25 * batch.response_mask)
    assert old.metrics == {"audit/replayed_frac": 1.0, "audit/failed": 0.0,
                           "audit/full_replay": 1.0, "audit/batch_shape_diff": 0.0,
                           "audit/stale": 0.0}



def test_a_stale_batch_is_replayed_whole_and_never_fails_the_audit():
    """A batch sampled by the weights before the learner's last update (async rollouts):
    old_logp is the learner's whole replay, however far from the sampler's logprobs, with no
    audit failure, no alert and no switch to full replay; `audit/stale` says so."""
    batch = _batch()
    learner = ReplayingLearner(batch, bad=tuple(range(N)), shift=0.25)
    audit = ReplayAudit(exact=True, fraction=0.125, full_every=8)
    old = audit.old_logp(learner, batch, SAMPLING, seed=0, step=3, stale=True)
    assert learner.calls == [list(range(N))]
    assert torch.allclose(old.logp, batch.rollout_logp + 0.25 * batch.response_mask)
    assert not audit.full_replay and audit.alert == ""
    assert old.metrics["audit/stale"] == 1.0 and old.metrics["audit/failed"] == 0.0
    assert old.metrics["audit/replayed_frac"] == 1.0 and "audit/abs_diff_max" not in old.metrics


def test_audited_rows_depend_on_seed_and_step_only():
    assert torch.equal(audited_rows(32, 0.125, 1, 5), audited_rows(32, 0.125, 1, 5))
    assert len(audited_rows(32, 0.125, 1, 5)) == 4 and len(audited_rows(3, 0.0, 0, 0)) == 1
    assert len(audited_rows(32, 1.0, 0, 0)) == 32
    draws = {tuple(audited_rows(32, 0.125, 1, s).tolist()) for s in range(8)}
    assert len(draws) > 1
    rows = audited_rows(32, 0.25, 2, 3)
    assert rows.tolist() == sorted(set(rows.tolist())) and 0 <= int(rows.min())
