"""Rollout engines: the `Engine` protocol, `LocalEngine` (KV-cache generation in this
process, on its own decode plan), the table of engines a recipe can name (`ENGINES`: local,
vLLM) and the sampler math.

See docs/architecture.md and qarl/rollout/README.md.
"""

from qarl.rollout.engine import LocalEngine
from qarl.rollout.engines import ENGINES, EngineKind
from qarl.rollout.protocol import Engine
from qarl.rollout.sampling import sample, token_logprobs, truncate_logits

__all__ = ["ENGINES", "Engine", "EngineKind", "LocalEngine", "sample", "token_logprobs", "truncate_logits"]
