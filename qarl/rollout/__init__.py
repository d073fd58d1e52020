"""Rollout engines: the `Engine` protocol, `LocalEngine` (KV-cache generation in this
process, on its own decode plan) and the sampler math.

See docs/architecture.md and qarl/rollout/README.md.
"""

from qarl.rollout.engine import LocalEngine
from qarl.rollout.protocol import Engine
from qarl.rollout.sampling import sample, token_logprobs, truncate_logits

__all__ = ["Engine", "LocalEngine", "sample", "token_logprobs", "truncate_logits"]
