"""Decode stretches change how much work the fleet simulator does, never what it decides: with
and without them every finished request's timings, every rejection, every replica's passes and
busy time are identical, where stretches are cut by arrivals, end in finishes, grow blocks,
share prefix-cache blocks, run the pool dry, and replay the step-cost fit (a TPOT target on),
with TTFT aging stretching passes and priority aging reordering the queues around them."""

import pytest

from everystop.core.scheduler import Scheduler
from everystop.routing import make_router
from everystop.sim.decode_stretch import DecodeStretch
from everystop.sim.fleet import FleetResult, Replica
from everystop.sim.fleet_run import simulate_fleet
from everystop.sim.fleet_workload import fleet_traffic
from everystop.sim.node import build_node

TRAFFIC = ("n=200,prompt=uniform:20:500,output=uniform:5:300,rate=25,tiers=0.3:0.4:0.3,"
           "prefix=0.5:48,sessions=0.4:3:1,tenants=2,seed=7")

# Few long replies on a small pool: stretches grow until the pool runs dry, some right after a
# finish, and the scheduler preempts in the pass that follows.
LONG_REPLIES = "n=60,prompt=uniform:100:400,output=uniform:200:600,rate=5,seed=3"

CASES = {
    # scheduling, KV blocks, scheduler options, router, stats interval, traffic
    "tight-pool": ("chunked", 420, {"preemption_mode": "auto"}, "least-loaded", 0.3, TRAFFIC),
    "tpot-target": ("continuous", 900, {"tpot_target_ms": 30.0}, "prefix-affinity", 0.25,
                    TRAFFIC),
    "every-arrival": ("chunked", 1500, {}, "power-of-two", 0.0, TRAFFIC),
    "odd-interval": ("continuous", 2000, {}, "round-robin", 0.1, TRAFFIC),
    "pool-runs-dry": ("chunked", 160, {"preemption_mode": "auto"}, "least-loaded", 0.5,
                      LONG_REPLIES),
    # Rule 5 on, per-tier targets: late prompts stretch the passes they join (checked below).
    "ttft-aging": ("chunked", 900, {"tpot_target_ms": 20.0, "ttft_target_ms": 150.0,
                                    "tpot_target_ms_per_tier": (15.0, None, 40.0)},
                   "least-loaded", 0.25, TRAFFIC),
    # Queues that wait past a short aging interval on a tight pool: priority aging reorders
    # them (the results differ with aging off, checked below) and starving prompts get floors.
    "priority-aging": ("chunked", 300, {"aging_interval_s": 0.3, "preemption_mode": "auto"},
                       "round-robin", 0.3, TRAFFIC),
}


def _run(case: str, stretches: bool, **override: object) -> FleetResult:
    scheduling, blocks, options, router, interval, traffic = CASES[case]
    options = {**options, **override}
    node = build_node("llama-3-8b", "a100-80gb", 1, scheduling, num_gpu_blocks=blocks,
                      max_num_seqs=32, swap_space_bytes=2 * 2**30, **options)
    replicas = 2 if traffic is LONG_REPLIES else 3
    return simulate_fleet(fleet_traffic(traffic), node.setup, node.cost.latency, replicas,
                          make_router(router), stats_interval_s=interval,
                          decode_stretches=stretches)


def _facts(res: FleetResult) -> tuple:
    return (sorted((f.request_id, f.replica, f.arrival_s, f.first_token_s, f.finished_s,
                    f.num_output_tokens, f.num_cached_tokens) for f in res.finished),
            sorted(res.rejected.items()), res.num_passes, res.busy_s, res.num_preemptions,
            res.end_time_s, res.num_routed)


@pytest.mark.parametrize("case", sorted(CASES))
def test_stretches_decide_exactly_what_single_passes_decide(case, monkeypatch):
    stretched = []
    begin = Replica.begin

    def spy(self, decode_stretches):
        event = begin(self, decode_stretches)
        stretched.append(self.stretch is not None)
        return event

    schedule = Scheduler.schedule
    tpot_stretches, bulk_rows = [], []

    def schedule_spy(self):
        out = schedule(self)
        tpot_stretches.append(out.tpot_stretch)
        bulk_rows.append(out.num_bulk_decodes)
        return out

    give_back = DecodeStretch.give_back
    given_back = []

    def give_back_spy(self, step):
        given_back.append(self.begun)
        give_back(self, step)

    monkeypatch.setattr(Replica, "begin", spy)
    monkeypatch.setattr(Scheduler, "schedule", schedule_spy)
    monkeypatch.setattr(DecodeStretch, "give_back", give_back_spy)
    fast = _run(case, True)
    assert sum(stretched) >= 10  # stretches really ran
    # and rode along the scheduler's own passes (held in bulk), given back where it preempted
    assert sum(n > 0 for n in bulk_rows) >= 10
    if case in ("tight-pool", "pool-runs-dry", "priority-aging"):
        assert given_back
    slow = _run(case, False)
    assert len(fast.finished) >= 60 and fast.num_preemptions >= 0
    assert _facts(fast) == _facts(slow)
    if case == "ttft-aging":
        assert max(tpot_stretches) > 1.0  # rule 5 fired
    if case == "priority-aging":
        assert _facts(_run(case, True, aging_interval_s=1e6)) != _facts(fast)  # aging decided


def test_a_report_between_passes_sees_what_single_passes_left():
    """Replica level: at every moment between two pass ends, a replica in a stretch (after
    catch_up, as a load report does) shows the same load as one run pass by pass, block growth
    at each pass start included, also right after a pass that finished requests."""
    from everystop.core.request import Request
    from everystop.sampling_params import SamplingParams
    from everystop.sim.fleet import PASS_END

    node = build_node("llama-3-8b", "a100-80gb", 1, "chunked", num_gpu_blocks=400,
                      max_num_seqs=32)

    def replica() -> Replica:
        r = Replica(0, node.setup, node.cost.latency)
        for i in range(12):
            req = Request(f"q{i}", [i % 3 + 1] * (40 + 7 * i), SamplingParams(
                max_tokens=30 + 23 * i, temperature=0.0, ignore_eos=True), arrival_time=1e-9)
            r.sched.add_request(req)
            r.routed[req.request_id] = (req, None)  # type: ignore[assignment]
        return r

    def facts(r: Replica) -> tuple:
        ld = r.load(0)
        return ld.num_running, ld.num_waiting, ld.free_kv_blocks, ld.prefill_tokens_queued

    slow = replica()
    timeline = []  # (pass end time, the load once it ended and the next pass started)
    end = slow.start_pass()
    while end is not None:
        slow.end_pass()
        end = slow.start_pass() if slow.sched.has_unfinished else None
        timeline.append((slow.clock.now, facts(slow)))

    fast = replica()
    event = fast.begin(True)
    checked = stretched = 0
    for (t0, want), (t1, _) in zip(timeline, timeline[1:]):
        probe = (t0 + t1) / 2
        while event is not None and event[0] < probe:
            if event[1] == PASS_END:
                fast.end_pass()
                over = True
            else:
                fast.end_stretch_step()
                over = fast.stretch_over()
            event = (fast.begin(True) if fast.sched.has_unfinished else None) if over else (
                fast.stretch_event())
        stretched += fast.stretch is not None
        fast.catch_up(probe)
        assert facts(fast) == want, f"at {probe}"
        checked += 1
    assert checked > 250 and stretched > 100
