"""Scale-out on Ray: several rollout engines behind one `Engine` (`RayEngines`).

Ray is an optional extra (`pip install 'qarl[ray]'`); nothing outside this package imports
it, and the trainer imports this package only when the recipe's [dist] section asks for
more than one process. See docs/distributed.md.
"""

from qarl.dist.cluster import connect
from qarl.dist.engines import RayEngines, shard_bounds

__all__ = ["RayEngines", "connect", "shard_bounds"]
