"""The fleet simulator: one replica is the single-node simulator exactly; the router in it is the
production router; policies order as they should on a skewed workload."""

import json

import pytest

from everystop.cli import main
from everystop.routing import Router, make_router
from everystop.sim.fleet_metrics import summarize_fleet
from everystop.sim.fleet_run import simulate_fleet
from everystop.sim.fleet_workload import SAMPLED_TOKEN, fleet_traffic, from_workload
from everystop.sim.metrics import summarize
from everystop.sim.node import build_node
from everystop.sim.simulator import simulate
from everystop.workload import load_workload, synthetic

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


def _skewed(tmp_path, n=160):
    """Alternating long and short jobs: round-robin over two replicas piles every long one on
    the same replica. (A trace file: the bench workload format is the stable interface.)"""
    path = tmp_path / "skewed.json"
    path.write_text(json.dumps({"name": "skewed", "requests": [
        {"id": f"s{i}", "prompt_len": 200, "max_tokens": 300 if i % 2 == 0 else 4,
         "arrival_s": i * 0.02} for i in range(n)]}))
    return load_workload(path)


def test_least_loaded_beats_round_robin_on_a_skewed_workload(tmp_path):
    node = build_node("llama-3-8b", "a100-80gb", 1, num_gpu_blocks=4000, max_num_seqs=32)
    runs = {}
    for policy in ("round-robin", "least-loaded"):
        res = simulate_fleet(from_workload(_skewed(tmp_path)), node.setup, node.cost.latency, 2,
                             make_router(policy), stats_interval_s=0.1)
        runs[policy] = (summarize_fleet(res, 1.0), res)
    rr, ll = runs["round-robin"][0], runs["least-loaded"][0]
    assert runs["round-robin"][1].num_routed == [80, 80]
    long_on_r0 = {f.request_id for f in runs["round-robin"][1].finished
                  if f.replica == 0 and f.num_output_tokens == 300}
    assert len(long_on_r0) in (0, 80)  # all long jobs on one replica
    assert ll["ttft_p99_ms"] < rr["ttft_p99_ms"]
    # Least-loaded spreads the output tokens: the two replicas' work is far more even.
    spread = {p: max(r.busy_s) / min(r.busy_s) for p, (_, r) in runs.items()}
    assert spread["least-loaded"] < spread["round-robin"]


def test_router_sees_reports_of_its_age_corrected_by_what_it_sent():
    """The simulator drives the production Router: every choice (best(): no queue caps here)
    gets one report per replica, no newer than the refresh interval, and on_sent/on_finished
    balance out."""
    calls = []

    class Spy(Router):
        def rank(self, request, loads):
            raise AssertionError("without queue caps only the first choice is asked for")

        def best(self, request, loads):
            calls.append([(ld.replica_id, ld.seq) for ld in loads])
            return super().best(request, loads)

    node = build_node("llama-3-8b", "a100-80gb", 1, num_gpu_blocks=2000)
    router = Spy()
    wl = synthetic("n=60,prompt=uniform:20:200,output=uniform:5:40,rate=20,seed=1")
    res = simulate_fleet(from_workload(wl), node.setup, node.cost.latency, 3, router,
                         stats_interval_s=0.5)
    assert len(res.finished) == 60 and len(calls) == 60
    assert all(sorted(r for r, _ in c) == ["r0", "r1", "r2"] for c in calls)
    assert len({c[0][1] for c in calls}) > 3  # reports refreshed during the run
    assert all(router.in_flight(r) == 0 for r in ("r0", "r1", "r2"))


@pytest.mark.parametrize("spec", ["n=3000,rate=50,sessions=0.5:4:5,seed=3",
                                  "n=3000,rate=50,arrival=onoff:5:10:3,seed=3",
                                  "n=3000,rate=50,arrival=diurnal:30:1.0,seed=3"])
def test_fleet_traffic_keeps_its_mean_rate_and_order(spec):
    reqs = list(fleet_traffic(spec))
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and len({r.request_id for r in reqs}) == 3000
    assert 40 < len(reqs) / times[-1] < 60


def test_sessions_resend_their_history():
    reqs = list(fleet_traffic("n=400,rate=20,sessions=1:3:2,prefix=1:64,tenants=2,seed=0"))
    by_prefix = {}
    for r in reqs:
        by_prefix.setdefault(tuple(r.prompt_token_ids[:80]), []).append(r)
    chats = [turns for turns in by_prefix.values() if len(turns) == 3]
    assert len(chats) > 50
    for first, second, _ in chats:
        history = first.prompt_token_ids + [SAMPLED_TOKEN] * first.max_tokens
        assert second.prompt_token_ids[:len(history)] == history
        assert second.arrival_s > first.arrival_s


def test_replayed_trace_matches_the_single_node_simulator_on_one_replica(tmp_path):
    wl = synthetic("n=40,prompt=uniform:20:200,output=uniform:5:40,rate=10,seed=4")
    trace = {"name": "t", "requests": [
        {"id": r.request_id, "prompt_len": r.prompt_len, "max_tokens": r.max_tokens,
         "arrival_s": r.arrival_s} for r in wl.requests]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    node = build_node("llama-3-8b", "a100-80gb", 1, num_gpu_blocks=2000)
    rc = main(["simulate", "--model", "llama-3-8b", "--tp", "1", "--workload", str(path),
               "--replicas", "1", "--out", str(tmp_path)])
    assert rc == 0
    fleet = json.loads((tmp_path / "fleet.json").read_text())["summary"]
    single = simulate(load_workload(path), build_node("llama-3-8b", "a100-80gb", 1).setup,
                      node.cost.latency)
    assert fleet["num_finished"] == 40
    assert fleet["ttft_p99_ms"] == summarize(single)["ttft_p99_ms"]


PLAN_ARGS = ["simulate", "plan", "--model", "llama-3-8b", "--hardware", "h100-sxm", "--tp", "1",
             "--rate", "60", "--slo-ttft-p99", "0.3", "--slo-tpot-p50", "0.02",
             "--traffic", "prompt=uniform:32:512,output=uniform:4:32", "--duration-s", "3",
             "--min-requests", "100"]


def test_plan_finds_the_fewest_replicas_that_meet_the_slo(tmp_path):
    out, out2 = tmp_path / "plan.json", tmp_path / "plan2.json"
    assert main([*PLAN_ARGS, "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    # on two processes per fleet run: the same search, the same plan
    assert main([*PLAN_ARGS, "--workers", "2", "--out", str(out2)]) == 0
    assert json.loads(out2.read_text()) == plan
    curve = {p["replicas"]: p for p in plan["curve"]}
    n = plan["replicas"]
    assert curve[n]["meets_slo"] and curve[n]["ttft_p99_ms"] <= 300
    assert n == 1 or not curve[n - 1]["meets_slo"]  # one fewer was tried and missed
    assert "GPU-hour" in plan["price_assumption"] and plan["cost_per_1m_output_tokens"] > 0


def test_static_batching_timeouts_across_replicas():
    """Stalled replicas wake on their batch timeout or on an arrival, whichever comes first, and
    a superseded wake-up never ends a pass in flight."""
    node = build_node("llama-3-8b", "a100-80gb", 1, "static", num_gpu_blocks=2000,
                      max_batch_size=4)
    wl = synthetic("n=90,prompt=uniform:20:200,output=uniform:5:40,rate=15,seed=2")
    res = simulate_fleet(from_workload(wl), node.setup, node.cost.latency, 3,
                         make_router("power-of-two", seed=1), stats_interval_s=0.2)
    assert len(res.finished) == 90 and not res.rejected
    assert all(f.finished_s > f.first_token_s >= f.arrival_s for f in res.finished)


def test_a_replica_reports_the_prompt_left_of_a_running_prefill():
    """As a real replica does (cluster/replica.py): a long prompt admitted and mid-chunk is
    still work ahead of a newcomer, or the router sends short requests in behind it."""
    from everystop.config import SchedulerConfig
    from everystop.core.request import Request
    from everystop.sampling_params import SamplingParams
    from everystop.sim.fleet import Replica
    from everystop.sim.simulator import SimSetup

    setup = SimSetup(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
                     num_gpu_blocks=200)
    replica = Replica(0, setup, lambda shape: 0.1)
    replica.sched.add_request(Request("long", list(range(1000)), SamplingParams(max_tokens=2)))
    replica.start_pass()  # the first 256-token chunk
    replica.end_pass()
    assert replica.sched.running and replica.load(1).prefill_tokens_queued == 1000 - 256


def test_the_cyclic_collector_is_off_during_a_run_and_back_on_after():
    """simulate_fleet keeps gc off while it runs (full passes re-walk its growing heap and find
    nothing) and restores it, also when the run fails."""
    import gc

    node = build_node("llama-3-8b", "a100-80gb", 1, "chunked", num_gpu_blocks=400)
    seen = []

    def latency(shape):
        seen.append(gc.isenabled())
        return node.cost.latency(shape)

    traffic = fleet_traffic("n=20,prompt=uniform:20:100,output=uniform:5:20,rate=20,seed=1")
    simulate_fleet(traffic, node.setup, latency, 2, make_router("least-loaded"))
    assert seen and not any(seen) and gc.isenabled()

    def failing(shape):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        simulate_fleet(fleet_traffic("n=3,seed=1"), node.setup, failing, 1,
                       make_router("least-loaded"))
    assert gc.isenabled()
