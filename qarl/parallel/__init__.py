"""Everything that runs in more than one process: rollout engines as Ray actors
(`RayEngines`), learner ranks over torch.distributed (`RankGroup`: the collectives of one
update; `learner_ranks`: starting ranks 1..M-1 on this machine or on a Ray cluster, `RayRanks`;
`ShardedLearner`: FSDP2 shards), and joining a Ray cluster (`connect`). See
docs/distributed.md.

It never imports `qarl.train`: what a follower rank runs, and the command that starts one
locally, are handed in by the trainer. Ray is an optional extra (`pip install 'qarl[ray]'`),
imported only by `cluster`, `ray_engines` and `ray_ranks`, which the trainer loads only when
the recipe's [dist] section asks for Ray; names are resolved lazily so `import
qarl.parallel.ranks` needs no Ray.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RayEngines": "qarl.parallel.ray_engines",
    "shard_bounds": "qarl.parallel.ray_engines",
    "RayRanks": "qarl.parallel.ray_ranks",
    "node_address": "qarl.parallel.ray_ranks",
    "connect": "qarl.parallel.cluster",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qarl.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
