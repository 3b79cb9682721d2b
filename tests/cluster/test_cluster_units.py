"""The cluster's pieces without a Ray instance: report parsing, stats summing, the router's
ordering and its in-flight books (Ray's RequestRouter base is not constructed)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any

from everystop.cluster.front import sum_stats
from everystop.cluster.router import EveryStopRouter, load_from_report
from everystop.core.outputs import SchedulerStats
from everystop.core.request import Request
from everystop.sampling_params import SamplingParams


def _stats(**kw: Any) -> dict[str, Any]:
    base = SchedulerStats(num_running=0, num_waiting=0, num_swapped=0, num_free_blocks=100,
                          num_used_blocks=0, num_total_blocks=100, kv_usage=0.0,
                          prefix_queries=0, prefix_hits=0, num_preemptions_recompute=0,
                          num_preemptions_swap=0, swap_out_blocks=0, swap_in_blocks=0)
    return {f.name: getattr(dataclasses.replace(base, **kw), f.name)
            for f in dataclasses.fields(base)}


def _report(seq: int, **kw: Any) -> dict[str, Any]:
    return {"seq": seq, "health": "ok", "pid": 1, "prefill_tokens_queued": 0,
            "stats": _stats(**kw)}


def test_a_report_becomes_a_replica_load() -> None:
    load = load_from_report("a", _report(3, num_waiting=2, num_running=5, num_free_blocks=40,
                                         num_used_blocks=60))
    assert (load.num_waiting, load.num_running, load.free_kv_blocks, load.seq) == (2, 5, 40, 3)
    assert load_from_report("b", None).seq == -1  # not reported yet: idle, ranked on queues


def test_cluster_stats_sum_the_replicas() -> None:
    total = sum_stats([_stats(num_running=2, num_used_blocks=30, num_free_blocks=70),
                       _stats(num_running=1, num_used_blocks=10, num_free_blocks=90,
                              step_measured_s=0.5)])
    assert total.num_running == 3 and total.num_total_blocks == 200
    assert total.kv_usage == 0.2 and total.step_measured_s == 0.5
    per_pos = sum_stats([_stats(spec_decode_num_accepted_tokens_per_pos=[5, 3]),
                         _stats(spec_decode_num_accepted_tokens_per_pos=[1, 1, 1]),
                         _stats()]).spec_decode_num_accepted_tokens_per_pos
    assert per_pos == [6, 4, 1]  # position by position, replicas of any k


def _router(policy: str = "least-loaded") -> EveryStopRouter:
    router = EveryStopRouter.__new__(EveryStopRouter)  # Ray's base needs a live deployment
    router.initialize_state(policy=policy, block_size=16)
    return router


def _replica(rid: str, report: dict[str, Any]) -> Any:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=report)


def _pending(req: Request, exclude: tuple[str, ...] = ()) -> Any:
    return SimpleNamespace(args=[req], kwargs={"exclude": exclude},
                           metadata=SimpleNamespace(internal_request_id=f"ray-{req.request_id}"))


def _req(i: int) -> Request:
    return Request(f"r{i}", list(range(40)), SamplingParams(max_tokens=4))


def _choose(router: EveryStopRouter, replicas: list[Any], pending: Any) -> list[str]:
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [rank[0].replica_id.unique_id for rank in ranks]


def test_a_burst_between_reports_alternates_replicas() -> None:
    router = _router()
    replicas = [_replica("a", _report(1)), _replica("b", _report(1))]
    firsts = [_choose(router, replicas, _pending(_req(i)))[0] for i in range(4)]
    assert sorted(firsts) == ["a", "a", "b", "b"]
    assert router.placed["r0"] == firsts[0] and sum(router.decisions.values()) == 4


def test_replicas_that_refused_go_last() -> None:
    router = _router()
    replicas = [_replica("a", _report(1)), _replica("b", _report(1, num_waiting=3))]
    assert _choose(router, replicas, _pending(_req(0))) == ["a", "b"]
    assert _choose(router, replicas, _pending(_req(1), exclude=("a",))) == ["b", "a"]


def test_a_choice_made_again_and_a_completion_leave_the_books_even() -> None:
    router = _router()
    replicas = [_replica("a", _report(1)), _replica("b", _report(1))]
    pending = _pending(_req(0))
    first = _choose(router, replicas, pending)[0]
    _choose(router, replicas, pending)  # Ray backed off and asked again: not counted twice
    assert router.policy.in_flight(first) == 1 and sum(router.decisions.values()) == 1
    assert +router.reasons == {"least_loaded": 1}
    other = "b" if first == "a" else "a"
    router.on_request_routed(pending, SimpleNamespace(unique_id=other), None)  # Ray chose else
    assert router.policy.in_flight(first) == 0 and router.policy.in_flight(other) == 1
    assert +router.reasons == {"ray_placed": 1}
    router.on_request_completed(SimpleNamespace(unique_id=other), "ray-r0")
    assert router.policy.in_flight(other) == 0


def test_the_metrics_say_why_the_router_chose() -> None:
    from everystop.cluster.metrics import ClusterCollector

    router = _router("prefix-affinity")
    replicas = [_replica("a", _report(1)), _replica("b", _report(1))]
    for i in range(3):  # the same 40-token prompt: a new prefix, then its replica twice
        _choose(router, replicas, _pending(_req(i)))
    front = SimpleNamespace(reports=lambda: {}, routers=lambda: [router], outcomes={},
                            retries={})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in ClusterCollector(front).collect()  # type: ignore[arg-type]
               for s in family.samples}
    name = "everystop_router_decisions_total"
    assert samples[(name, (("policy", "prefix-affinity"), ("reason", "new_prefix")))] == 1
    assert samples[(name, (("policy", "prefix-affinity"), ("reason", "affinity")))] == 2


def test_every_front_door_defaults_to_the_routing_floors_affinity_margin() -> None:
    import argparse

    from everystop.cluster.deploy import ClusterOptions
    from everystop.routing import DEFAULT_AFFINITY_MARGIN
    from everystop.server.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["serve"]).affinity_margin == DEFAULT_AFFINITY_MARGIN
    assert ClusterOptions().affinity_margin == DEFAULT_AFFINITY_MARGIN


def test_power_of_two_hands_ray_its_two_draws_as_one_group() -> None:
    """Ray's built-in procedure picks between the two by its own queue lengths; a retry after
    refusals keeps the refusing replicas last, one by one."""
    router = _router("power-of-two")
    replicas = [_replica(r, _report(1)) for r in ("a", "b", "c")]
    ranks = asyncio.run(router.choose_replicas(replicas, _pending(_req(0))))
    assert [len(rank) for rank in ranks] == [2, 1]
    assert sorted(r.replica_id.unique_id for rank in ranks for r in rank) == ["a", "b", "c"]
    ranks = asyncio.run(router.choose_replicas(replicas, _pending(_req(1), exclude=("a",))))
    assert [len(rank) for rank in ranks] == [1, 1, 1]
    assert ranks[-1][0].replica_id.unique_id == "a"


def test_an_admin_call_goes_to_the_replica_it_names() -> None:
    router = _router()
    replicas = [_replica("a", _report(1)), _replica("b", _report(1, num_waiting=3))]
    call = SimpleNamespace(args=["get"], kwargs={"target": "b"},
                           metadata=SimpleNamespace(internal_request_id="ray-admin"))
    assert _choose(router, replicas, call) == ["b"]
    assert sum(router.decisions.values()) == 0  # not a request: nothing booked


def test_flags_cluster_mode_would_ignore_are_refused_and_local_starts_ray() -> None:
    import argparse

    from everystop.cluster.deploy import options_from_args, unsupported_flags
    from everystop.server.cli import register, scaled_out

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert unsupported_flags(parser.parse_args(["serve", "--replicas", "2"])) == []
    args = parser.parse_args(["serve", "--replicas", "2", "--telemetry-db", "t.db",
                              "--engine-stall-timeout", "5"])
    assert unsupported_flags(args) == ["--telemetry-db", "--engine-stall-timeout"]
    local = parser.parse_args(["serve", "--ray-address", "local"])
    assert scaled_out(local) and options_from_args(local).ray_address is None


def test_the_single_engine_server_does_not_import_ray() -> None:
    """Ray is an optional extra: `everystop serve` without --replicas never imports it."""
    import subprocess
    import sys

    code = ("import sys, everystop.cli, everystop.server.cli, everystop.server.app, "
            "everystop.server.admin, everystop.routing\n"
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _record_calls(router: Any) -> list[tuple[Any, ...]]:
    """Log a policy's rank / best / on_sent / on_finished calls (with the answer) as they
    happen (a best() that ranks through rank() is logged once, as that rank)."""
    calls: list[tuple[Any, ...]] = []
    rank, best, sent, finished = router.rank, router.best, router.on_sent, router.on_finished

    def recording_rank(route: Any, loads: Any) -> list[str]:
        order = rank(route, loads)
        calls.append(("rank", route, list(loads), order))
        return order

    def recording_best(route: Any, loads: Any) -> str | None:
        before = len(calls)
        first = best(route, loads)
        if len(calls) == before:
            calls.append(("best", route, list(loads), first))
        return first

    def recording_sent(rid: str, route: Any) -> None:
        calls.append(("sent", rid, route))
        sent(rid, route)

    def recording_finished(rid: str, route: Any) -> None:
        calls.append(("finished", rid, route))
        finished(rid, route)

    router.rank, router.best, router.on_sent, router.on_finished = (
        recording_rank, recording_best, recording_sent, recording_finished)
    return calls


def test_the_simulator_and_the_ray_router_make_the_same_choices() -> None:
    """A fleet simulation's every routing call replayed through the Ray Serve router: the same
    load reports and the same sends and finishes give the same ranking and the same
    `RouteRequest` (the one `route_request` both build), for every policy."""
    from everystop.routing import POLICIES, make_router
    from everystop.sim.fleet_run import simulate_fleet
    from everystop.sim.fleet_workload import fleet_traffic
    from everystop.sim.node import build_node

    # Prompts of every length mod 16 (the block count's edge), stale reports, a pool that fills.
    specs = list(fleet_traffic("n=120,prompt=uniform:1:400,output=uniform:2:60,rate=30,"
                               "prefix=0.5:48,sessions=0.3:3:0.5,seed=5"))
    node = build_node("llama-3-8b", "a100-80gb", 1, num_gpu_blocks=200, max_num_seqs=8)
    for policy in POLICIES:
        sim_router = make_router(policy)
        calls = _record_calls(sim_router)
        result = simulate_fleet(iter(specs), node.setup, node.cost.latency, 3, sim_router,
                                stats_interval_s=0.5)
        assert not result.rejected and len(result.finished) == len(specs)

        ray = _router(policy)
        arrivals = iter(specs)
        key_of: dict[int, str] = {}  # id of the simulator's RouteRequest -> Ray's request key
        pending: Any = None
        for call in calls:
            if call[0] in ("rank", "best"):  # best: the simulator asked for the first only
                kind, route, loads, order = call
                spec = next(arrivals)
                req = Request(spec.request_id, spec.prompt_token_ids,
                              SamplingParams(max_tokens=spec.max_tokens))
                pending = _pending(req)
                replicas = [_replica(ld.replica_id, {
                    "seq": ld.seq, "prefill_tokens_queued": ld.prefill_tokens_queued,
                    "stats": {"num_waiting": ld.num_waiting, "num_running": ld.num_running,
                              "num_swapped": ld.num_swapped, "num_free_blocks": ld.free_kv_blocks,
                              "num_total_blocks": ld.total_kv_blocks}}) for ld in loads]
                ranks = asyncio.run(ray.choose_replicas(replicas, pending))
                ray_order = [r.replica_id.unique_id for g in ranks for r in g]
                assert (ray_order if kind == "rank" else ray_order[0]) == order, policy
                ray_route = ray._in_flight[pending.metadata.internal_request_id][1]
                same = ("kv_blocks_needed", "num_prompt_tokens") + (
                    ("prefix_hashes",) if policy == "prefix-affinity" else ())
                assert [getattr(ray_route, f) for f in same] == [getattr(route, f) for f in same]
                key_of[id(route)] = pending.metadata.internal_request_id
            elif call[0] == "sent":
                if call[1] != ray._in_flight[key_of[id(call[2])]][0]:  # QueueFull: the next
                    ray.on_request_routed(pending, SimpleNamespace(unique_id=call[1]), None)
            else:
                ray.on_request_completed(SimpleNamespace(unique_id=call[1]), key_of[id(call[2])])
        assert not ray._in_flight, policy
        assert next(arrivals, None) is None
