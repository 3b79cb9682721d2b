"""The fleet simulation on worker processes (sim/fleet_parallel.py) gives the one-process run's
results exactly: every finished record in the same order, every rejection, every replica's
passes and busy time, and the router's own account of why each request went where it went."""

from collections import Counter

import pytest

from everystop.routing import make_router
from everystop.sim import fleet_parallel
from everystop.sim.fleet import FleetResult
from everystop.sim.fleet_run import simulate_fleet
from everystop.sim.fleet_workload import fleet_traffic
from everystop.sim.node import build_node

# Tiers, tenants, shared prefixes, sessions and a pool small enough to preempt; a session's
# later turns (its history grows) outgrow the model length and are rejected.
TRAFFIC = ("n=240,prompt=uniform:20:900,output=uniform:5:200,rate=80,tiers=0.3:0.4:0.3,"
           "prefix=0.4:64,sessions=0.5:3:1,tenants=3,seed=4")


def _run(workers: int, router: str, interval: float, scheduling: str = "chunked",
         traffic: str = TRAFFIC, **options) -> tuple[FleetResult, dict]:
    node = build_node("llama-3-8b", "a100-80gb", 1, scheduling, num_gpu_blocks=400,
                      max_num_seqs=16, max_model_len=1600, swap_space_bytes=2**30, **options)
    r = make_router(router, seed=3)
    result = simulate_fleet(fleet_traffic(traffic), node.setup, node.cost.latency, 5, r,
                            stats_interval_s=interval, workers=workers)
    return result, dict(r.reasons)


@pytest.mark.parametrize("router,interval", [("least-loaded", 0.5), ("prefix-affinity", 0.0),
                                             ("power-of-two", 0.25), ("round-robin", 1.0)])
def test_two_and_three_workers_simulate_exactly_what_one_process_does(router, interval):
    one, reasons = _run(1, router, interval)
    assert len(one.finished) > 200 and one.rejected and one.num_preemptions > 0
    for workers in (2, 3):
        many, many_reasons = _run(workers, router, interval)
        assert many.finished == one.finished  # records and their order
        assert many.rejected == one.rejected
        assert (many.num_passes, many.busy_s, many.num_routed) == (
            one.num_passes, one.busy_s, one.num_routed)
        assert (many.num_preemptions, many.end_time_s) == (one.num_preemptions, one.end_time_s)
        assert many_reasons == reasons


# Several arrivals per pass (400/s over 5 replicas, no pass under ~11 ms): each group applies
# pass ends ahead of the arrivals that cannot change them, so arrivals reach replicas whose
# last pass has ended here but not yet continued (its stretch cut there, or a request no
# replica can run queued there, refused at the continuation).
BUSY = TRAFFIC.replace("n=240", "n=600").replace("rate=80", "rate=400")


@pytest.mark.parametrize("router,interval", [("least-loaded", 0.5), ("prefix-affinity", 1.0)])
def test_groups_looking_ahead_of_the_arrivals_still_simulate_what_one_process_does(
        router, interval, monkeypatch):
    seen = Counter()
    real_offer, real_end_part = fleet_parallel.offer, fleet_parallel.end_part

    def offer(r, spec, *rest):  # the parent's own group (a worker's are counted in it)
        seen["to a parked replica"] += r.parked is not None
        return real_offer(r, spec, *rest)

    def end_part(*args):
        seen["pass ends applied ahead"] += 1
        return real_end_part(*args)

    monkeypatch.setattr(fleet_parallel, "offer", offer)
    monkeypatch.setattr(fleet_parallel, "end_part", end_part)
    one, reasons = _run(1, router, interval, traffic=BUSY)
    assert len(one.finished) > 500 and len(one.rejected) > 20
    for workers in (2, 3):
        many, many_reasons = _run(workers, router, interval, traffic=BUSY)
        assert many.finished == one.finished and many.rejected == one.rejected
        assert (many.num_passes, many.busy_s, many.num_routed, many.end_time_s) == (
            one.num_passes, one.busy_s, one.num_routed, one.end_time_s)
        assert many_reasons == reasons
    assert seen["pass ends applied ahead"] > 100 and seen["to a parked replica"] > 50


def test_replicas_are_dealt_evenly_with_a_smaller_share_for_the_parent():
    groups = fleet_parallel.deal(64, 2)
    assert groups.count(0) == 29 and groups.count(1) == 35
    assert max(len(run) for run in "".join(map(str, groups)).split("1")) == 1  # spread out
    assert sorted(set(fleet_parallel.deal(64, 3))) == [0, 1, 2]
    assert fleet_parallel.deal(2, 2) == [0, 1] and fleet_parallel.deal(3, 3) == [0, 1, 2]


def test_queue_caps_refusals_go_to_the_next_replica_as_in_one_process():
    """With a tenant queue cap, a replica may refuse (QueueFull) and the router tries its next
    choice at the same moment: the parallel run waits for each offer's answer. (Static batches:
    an idle replica gathering a batch holds a queue, where an arrival can be refused.)"""
    caps = {"max_queued_per_tenant": 2, "max_batch_size": 6}
    one, reasons = _run(1, "least-loaded", 0.5, "static", **caps)
    many, many_reasons = _run(2, "least-loaded", 0.5, "static", **caps)
    assert reasons.get("next_in_rank", 0) > 0  # refusals happened and were retried
    assert many.finished == one.finished and many.rejected == one.rejected
    assert many_reasons == reasons and many.num_routed == one.num_routed


def test_a_failure_in_a_worker_is_raised_in_the_caller():
    node = build_node("llama-3-8b", "a100-80gb", 1, "chunked", num_gpu_blocks=400)

    def failing(shape):
        raise ValueError("boom in a worker")

    with pytest.raises(ValueError, match="boom in a worker"):
        simulate_fleet(fleet_traffic("n=10,seed=1"), node.setup, failing, 2,
                       make_router("least-loaded"), workers=2)


def test_simulate_takes_workers_on_the_command_line(tmp_path, capsys):
    import json

    from everystop.cli import main

    spec = "n=60,prompt=uniform:20:300,output=uniform:5:60,rate=20,seed=2"
    summaries = []
    for workers in ("1", "2"):
        out = tmp_path / workers
        assert main(["simulate", "--model", "llama-3-8b", "--tp", "1", "--traffic", spec,
                     "--replicas", "3", "--workers", workers, "--out", str(out)]) == 0
        summaries.append(json.loads((out / "fleet.json").read_text())["summary"])
    assert summaries[0]["num_finished"] == 60 and summaries[0] == summaries[1]
    assert main(["simulate", "--traffic", spec, "--replicas", "3", "--workers", "0"]) != 0
    assert "--workers must be >= 1, not 0" in capsys.readouterr().err


@pytest.mark.parametrize("ids", [[], [0, 1, 2**31 - 1, -5] + list(range(600)), [2**40, 3]])
def test_a_fleet_request_crosses_a_process_boundary_unchanged(ids):
    """Pickled for a worker with its prompt packed (ids beyond 32 bits as a plain list): the
    same request comes out, its prompt a list of ints again."""
    import pickle

    from everystop.sim.fleet_workload import FleetRequest

    req = FleetRequest("r1", 0.25, ids, 17, priority=2, tenant="t")
    back = pickle.loads(pickle.dumps(req))
    assert back == req and type(back.prompt_token_ids) is list
    assert all(type(i) is int for i in back.prompt_token_ids)
    packed = b"_array_reconstructor" in pickle.dumps(req)  # one bytes object, not id by id
    assert packed == (max(ids, default=0) < 2**31)
