"""The fleet simulation, in this process (sim/fleet.py) or over several (sim/fleet_parallel.py):
the same results either way."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from everystop.routing import Router
from everystop.sim.cost_model import IterationShape
from everystop.sim.fleet import FleetResult, simulate_fleet_serial
from everystop.sim.fleet_workload import FleetRequest
from everystop.sim.simulator import SimSetup


def simulate_fleet(requests: Iterable[FleetRequest], setup: SimSetup,
                   latency_fn: Callable[[IterationShape], float], num_replicas: int,
                   router: Router, *, stats_interval_s: float = 1.0,
                   decode_stretches: bool = True, workers: int = 1) -> FleetResult:
    """Route `requests` (in arrival order) over `num_replicas` simulated replicas.

    `stats_interval_s`: how often the router gets fresh load reports; 0 = at every arrival.
    `decode_stretches=False`: every pass through the scheduler (the same results, slower).
    `workers` > 1: the replicas spread over that many processes."""
    if workers > 1 and num_replicas > 1:
        from everystop.sim.fleet_parallel import simulate_fleet_parallel  # forks workers

        return simulate_fleet_parallel(requests, setup, latency_fn, num_replicas, router,
                                       stats_interval_s=stats_interval_s,
                                       decode_stretches=decode_stretches, workers=workers)
    return simulate_fleet_serial(requests, setup, latency_fn, num_replicas, router,
                                 stats_interval_s=stats_interval_s,
                                 decode_stretches=decode_stretches)
