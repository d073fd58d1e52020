"""old_logp: a replay, or, where the replay is exact by construction, an audit of one.

The learner's `old_logp` is its logprobs of the sampled tokens by the engine's own decode
path (`Learner.replay`). Where learner and engine run the same computation on this machine
(`kernel` alignment, or full-precision rollouts, with the local engine and a dense model),
that replay reproduces the sampler's logprobs bit for bit: it is a second generation pass
that computes what the engine already reported. There `ReplayAudit` takes the sampler's
logprobs as old_logp and replays only a sampled fraction of the rows (`train.audit_fraction`,
at least one row) and the whole batch every `train.audit_full_every` steps (from step 0), in
the batch's own shape (its prompt and response widths: the kernels are batch-invariant, so a
row replayed with fewer others has the same bits). An audited row that differs in any bit is
an alert only if the whole batch, replayed in its sampled shape, differs too: then the step
uses that replay, `audit/failed` is 1 in its metrics, the log says so, and the run replays
every row from then on (`full_replay`, kept in its checkpoints). Where the whole replay equals
the sampler's logprobs, the difference came from the audited rows' smaller batch alone (a
kernel whose rounding depends on the batch: rare, and of last-bit size, while the whole replay
matches bit for bit): the step keeps the sampler's logprobs,
`audit/batch_shape_diff` records the difference, and the audits go on. `naive` / `fake`
alignment, vLLM and mixture-of-experts models (whose routing metrics need the learner's own
experts on every row) always replay the whole batch.

Which rows are audited is a function of (run.seed, step), so a resumed run audits the rows
the uninterrupted one would.

A stale batch (train.async_rollouts: sampled by the weights before the learner's last
update) is not the learner's to reproduce: its old_logp is the learner's whole replay at its
current weights, and nothing is compared (`audit/stale` = 1; `audit/failed` stays 0, and
the run's full-replay switch is left as it was). The audit then compares only batches
sampled by the learner's own version: every step's with async_staleness = 0, the first
step's with 1. The sampler's side of the contract is still checked at every push: the
digests of what each engine holds against what the learner pushed (qarl/train/sync.py).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qarl.train.learner.learner import Learner
from qarl.types import RolloutBatch, SamplingParams


@dataclass
class OldLogp:
    """What the old_logp phase gives the step."""

    logp: Tensor  # [N, L] float32, old_logp of every row
    routing: Tensor | None  # MoE: the learner routers' experts (a whole replay), else None
    replayed_rows: Tensor  # [n] int64, the rows whose old_logp a replay computed (sorted)
    replayed_logp: Tensor  # [n, L] float32, their replayed logprobs
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ReplayAudit:
    """How a run computes old_logp (module docstring). `exact`: the replay is exact by
    construction here; `fraction` / `full_every`: the recipe's audit settings."""

    exact: bool
    fraction: float
    full_every: int
    full_replay: bool = False  # an audit found a difference: every row is replayed from then on
    alert: str = ""  # what the last failed audit found

    def old_logp(self, learner: Learner, batch: RolloutBatch, sampling: SamplingParams,
                 seed: int, step: int, stale: bool = False) -> OldLogp:
        """`stale`: the batch was sampled by an older weight version than the learner's
        (module docstring): a whole replay, compared with nothing."""
        N = batch.num_sequences
        if stale:
            result = _whole_replay(learner, batch, sampling, for_update=True)
            result = self._with_metrics(result, N)
            result.metrics["audit/stale"] = 1.0
            return result
        whole = (not self.exact or self.full_replay
                 or (self.full_every > 0 and step % self.full_every == 0))
        if whole:
            result = _whole_replay(learner, batch, sampling, for_update=True)
            if self.exact and not self.full_replay:
                return self._checked(result, batch, step)
            return self._with_metrics(result, N)
        rows = audited_rows(N, self.fraction, seed, step)
        replayed, _ = learner.replay(batch.select(rows), sampling)
        result = OldLogp(batch.rollout_logp, None, rows, replayed)
        return self._checked(result, batch, step, learner, sampling)

    def _checked(self, result: OldLogp, batch: RolloutBatch, step: int,
                 learner: Learner | None = None, sampling: SamplingParams | None = None) -> OldLogp:
        """Compare the replayed rows with the sampler's logprobs; on any difference raise the
        alert, switch to full replay and (for a partial audit) replay the whole batch."""
        rows = result.replayed_rows
        mask = batch.response_mask[rows]  # [n, L] bool
        sampled = batch.rollout_logp[rows]
        diff = float((result.replayed_logp - sampled).abs()[mask].max()) if mask.any() else 0.0
        if torch.equal(result.replayed_logp[mask], sampled[mask]):
            return self._with_metrics(result, batch.num_sequences, difference=diff)
        if learner is not None:  # a partial audit: the whole batch, in its sampled shape, decides
            whole = _whole_replay(learner, batch, sampling)
            full_mask = batch.response_mask
            if torch.equal(whole.logp[full_mask], batch.rollout_logp[full_mask]):
                # the sampler's logprobs are the whole replay's: only the audited rows' smaller
                # batch computed differently (a batch-shape effect, not a stale policy)
                return self._with_metrics(whole, batch.num_sequences, difference=0.0,
                                          batch_shape_diff=diff)
            result = whole
        else:
            result.logp = result.replayed_logp
        self.full_replay = True
        self.alert = (f"step {step + 1}: the replay audit found the learner's logprobs up to "
                      f"{diff:.3g} nats from the sampler's on {len(rows)} audited rows, where "
                      "they are exact by construction (a changed kernel, a broken weight sync, "
                      "a CPU whose kernels differ between engine and learner?); old_logp is "
                      "now the learner's full replay, for this and every later step")
        return self._with_metrics(result, batch.num_sequences, difference=diff, failed=True)

    def _with_metrics(self, result: OldLogp, N: int, difference: float | None = None,
                      failed: bool = False, batch_shape_diff: float = 0.0) -> OldLogp:
        result.metrics = {"audit/replayed_frac": len(result.replayed_rows) / max(1, N),
                          "audit/failed": float(failed),
                          "audit/full_replay": float(self.full_replay or not self.exact),
                          "audit/batch_shape_diff": batch_shape_diff, "audit/stale": 0.0}
        if difference is not None:
            result.metrics["audit/abs_diff_max"] = difference
        return result


def _whole_replay(learner: Learner, batch: RolloutBatch, sampling: SamplingParams,
                  for_update: bool = False) -> OldLogp:
    """old_logp of every row by the learner's replay of the whole batch, in its sampled shape
    (for_update: `Learner.replay`'s, the old_logp phase of the batch's update)."""
    logp, routing = learner.replay(batch, sampling, for_update)
    return OldLogp(logp, routing, torch.arange(batch.num_sequences), logp)


def audited_rows(num_rows: int, fraction: float, seed: int, step: int) -> Tensor:
    """The rows a partial audit replays at `step`: ceil(fraction * N) of them, at least one,
    drawn by (seed, step) alone; sorted. -> [n] int64."""
    n = min(num_rows, max(1, math.ceil(fraction * num_rows)))
    picked = random.Random(f"audit:{seed}:{step}").sample(range(num_rows), n)
    return torch.tensor(sorted(picked), dtype=torch.long)
