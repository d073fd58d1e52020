"""Rollout engines: `LocalEngine` (KV-cache generation in this process) and the sampler math.

See docs/architecture.md and qarl/rollout/README.md.
"""

from qarl.rollout.engine import LocalEngine
from qarl.rollout.sampling import sample, token_logprobs, truncate_logits

__all__ = ["LocalEngine", "sample", "token_logprobs", "truncate_logits"]
