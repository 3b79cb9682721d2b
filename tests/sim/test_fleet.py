"""The fleet simulator: one replica is the single-node simulator exactly; the router in it is the
production router; policies order as they should on a skewed workload."""

import pytest

from everystop.routing import make_router
from everystop.sim.fleet import simulate_fleet
from everystop.sim.fleet_workload import from_workload
from everystop.sim.node import build_node
from everystop.sim.simulator import simulate
from everystop.sim.workload import synthetic

MIXED = ("n=120,prompt=uniform:20:600,output=uniform:5:120,rate=30,priority=0.3:0.4:0.3,"
         "prefix=0.4:64,tenants=3,seed=5")


@pytest.mark.parametrize("scheduling,blocks", [("chunked", 600), ("continuous", 300),
                                               ("static", 2000)])
def test_one_replica_is_the_single_node_simulator(scheduling, blocks):
    node = build_node("llama-3-8b", "a100-80gb", 1, scheduling, num_gpu_blocks=blocks,
                      max_num_seqs=24, max_batch_size=8)
    wl = synthetic(MIXED)
    single = simulate(wl, node.setup, node.cost.latency)
    fleet = simulate_fleet(from_workload(wl), node.setup, node.cost.latency, 1,
                           make_router("least-loaded"), stats_interval_s=0.5)
    want = {r.request_id: (r.first_token_time, r.finished_time, r.num_output_tokens,
                           max(0, r.num_cached_tokens))
            for r in single.requests if r.finished_time is not None}
    got = {f.request_id: (f.first_token_s, f.finished_s, f.num_output_tokens,
                          f.num_cached_tokens) for f in fleet.finished}
    assert len(want) > 100 and got == want
    assert fleet.rejected == single.rejected
    assert fleet.num_passes == [len(single.iterations)]
    assert fleet.busy_s[0] == pytest.approx(sum(it.latency_s for it in single.iterations))
    assert sum(single.num_preemptions.values()) == fleet.num_preemptions
