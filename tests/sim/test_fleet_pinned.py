"""A seeded fleet run's every timing, pinned: speed work on the scheduler, the KV cache manager
and the fleet loop must not change what they decide (a digest of every finished request's
timings, every rejection, every replica's pass count and busy time)."""

import hashlib

import pytest

from everystop.routing import make_router
from everystop.sim.fleet import FleetResult
from everystop.sim.fleet_run import simulate_fleet
from everystop.sim.fleet_workload import fleet_traffic
from everystop.sim.node import build_node

# Priorities, tenants, shared prefixes and multi-turn sessions, on a pool small enough to
# preempt (recompute and swap): every branch of the hot path the speed work touches.
TRAFFIC = ("n=260,prompt=uniform:20:700,output=uniform:5:200,rate=40,tiers=0.3:0.4:0.3,"
           "prefix=0.4:64,sessions=0.5:3:1,tenants=3,seed=11")

# A digest changes only when a routing or scheduling decision does; re-pin it on purpose, with
# the change's effect (hit rate, preemptions, p99 TTFT) in the commit message.
CASES = {
    # scheduling, KV blocks, scheduler options, router, stats interval, digest
    "chunked-swap": ("chunked", 700, {"preemption_mode": "auto"}, "prefix-affinity", 0.5,
                     "c5a3b6592505184a"),
    "continuous-auto-tpot": ("continuous", 900, {"tpot_target_ms": None}, "least-loaded", 0.0,
                             "e08ddf1f135321b7"),
    "static": ("static", 3000, {"max_batch_size": 8}, "round-robin", 1.0, "805b8cc1d004bb27"),
}


def digest(result: FleetResult) -> str:
    rows = sorted(repr((f.request_id, f.replica, f.arrival_s, f.first_token_s, f.finished_s,
                        f.num_prompt_tokens, f.num_output_tokens, f.num_cached_tokens))
                  for f in result.finished)
    rows.append(repr(sorted(result.rejected.items())))
    rows.append(repr((result.num_passes, result.busy_s, result.num_preemptions,
                      result.end_time_s, result.num_routed)))
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_seeded_fleet_run_is_unchanged(case, workers):
    scheduling, blocks, options, router, interval, want = CASES[case]
    node = build_node("llama-3-8b", "a100-80gb", 1, scheduling, num_gpu_blocks=blocks,
                      max_num_seqs=24, swap_space_bytes=2 * 2**30, **options)
    result = simulate_fleet(fleet_traffic(TRAFFIC), node.setup, node.cost.latency, 3,
                            make_router(router), stats_interval_s=interval, workers=workers)
    assert len(result.finished) > 200
    assert digest(result) == want
