"""Which replica a new request goes to: load reports in, a ranking of replicas out.

Plain Python with no Ray import, so the Ray Serve router (`everystop.cluster`) and the fleet
simulator (`everystop.sim`) run the very same policy."""

from everystop.routing.load import ReplicaLoad, RouteRequest, ScoreWeights
from everystop.routing.policies import DEFAULT_AFFINITY_MARGIN, POLICIES, Router, make_router
from everystop.routing.prefix import prefix_block_hashes, route_request

__all__ = ["DEFAULT_AFFINITY_MARGIN", "POLICIES", "ReplicaLoad", "RouteRequest", "Router",
           "ScoreWeights", "make_router", "prefix_block_hashes", "route_request"]
