"""Scale-out on Ray: several rollout engines behind one `Engine` (`RayEngines`), and learner
ranks placed by the cluster (`RayRanks`).

Ray is an optional extra (`pip install 'qarl[ray]'`); nothing outside this package imports
it, and the trainer imports this package only when the recipe's [dist] section asks for
more than one process. See docs/distributed.md.
"""

from qarl.dist.cluster import connect
from qarl.dist.engines import RayEngines, shard_bounds
from qarl.dist.learners import RayRanks, node_address

__all__ = ["RayEngines", "RayRanks", "connect", "node_address", "shard_bounds"]
