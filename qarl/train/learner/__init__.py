"""The learner: master weights in the rollout format, their passes and their update.

- `learner`: `Learner` (what the trainer asks of it) and `AlignedLearner`, one process's;
- `passes`: `Passes`, the value pass (old_logp: the engine's decode path replayed, or the
  teacher-forced forward) and the gradient pass, which gives logp's value at each optimizer
  step, and the update's first forward run ahead by the old_logp phase;
- `precision`: `Precision`, what the gradient pass computes in, resolved once at set-up;
- `logprobs`: the teacher-forced logprobs and the forward scorer;
- `update`: the epochs of micro-batched backward passes and optimizer steps, with the guards;
- `audit`: old_logp where the replay is exact by construction (`kernel` alignment), an audit;
- `optim`: AdamW / Muon and the learning-rate schedule;
- `reference`: the KL term's reference policy (the learner as the run starts, frozen);
- `follow`: the learner on several ranks (replicated or FSDP).

docs/learner.md is the reference.
"""

from qarl.train.learner.learner import AlignedLearner, Learner
from qarl.train.learner.passes import Passes
from qarl.train.learner.precision import Precision

__all__ = ["AlignedLearner", "Learner", "Passes", "Precision"]
