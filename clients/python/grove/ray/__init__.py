"""Grove on Ray: sandboxes, snapshots and forks across many nodes, placed by Ray's scheduler.

Each node runs groved and a Ray node started by `python -m grove.ray.node`, which advertises the node's capacity as
the `grove_slots` resource and its labels as Ray node labels. `Fleet` places through Ray and then talks to the chosen
node's groved directly. Needs `ray` (pip install grove-client[ray])."""

from .fleet import Fleet, FleetNode, FleetSandbox, FleetSnapshot, Placement, spread
from .node import SLOT

__all__ = ["Fleet", "FleetNode", "FleetSandbox", "FleetSnapshot", "Placement", "SLOT", "spread"]
