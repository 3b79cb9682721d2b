"""Many simulated replicas behind the production router, on one discrete-event clock.

Each replica is the production `Scheduler` + `KVCacheManager` with its own clock, its passes
timed by the cost model, exactly as `simulator.simulate` drives one node. A request is routed on
arrival by `everystop.routing` (the scoring function the Ray Serve router uses), which sees each
replica's load report as it was at the last refresh (every `stats_interval_s`), corrected by its
own count of requests sent and finished since: the router's information delay.

Events, in time order (ties: reports, then arrivals, then pass starts/ends, then by sequence)::

    report      every replica's ReplicaLoad is taken (the router's next refresh)
    arrival     router.rank -> the first replica that takes it (QueueFull: the next;
                without queue caps only the first is asked: router.best)
    pass start  an idle replica with work schedules a pass; it ends `latency` later
    pass end    update_from_output, finished requests leave (router.on_finished), queued
                arrivals join, the next pass starts at once

A replica busy with a pass keeps arrivals in an inbox until the pass ends, as the single-node
loop does, so with one replica the schedule is identical to `simulate` (a test checks it).
Events at equal times and kinds go in replica order. A report taken at the interval's grid point
G = k * stats_interval_s holds what every event before G left (whichever event comes to take it).

A replica that is pure decode with nothing waiting runs a `DecodeStretch` instead of one event
per pass: its pass times are planned ahead and their effects applied lazily, made visible
exactly where the per-pass loop would show them (sim/decode_stretch.py): the same results, a
fraction of the work (`decode_stretches=False` runs every pass through the scheduler). An
arrival hands the next passes back to the scheduler, the stretch's rows riding along in bulk
(`Scheduler.decode_batch`, core/decode_batch.py) until every row decodes again.
Requests are consumed lazily and forgotten when they finish (only their timings are kept), so a
million requests fit in memory.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from everystop.config import SchedulerConfig
from everystop.core.decode_batch import EAGER_DECODES
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.outputs import ModelOutput, SchedulerOutput
from everystop.core.request import Request
from everystop.core.scheduler import QueueFull, RequestRejected, Scheduler
from everystop.routing import ReplicaLoad, Router, route_request
from everystop.routing.policies import PrefixAffinityRouter
from everystop.sampling_params import SamplingParams
from everystop.sim.cost_model import IterationShape
from everystop.sim.decode_stretch import DecodeStretch, can_stretch
from everystop.sim.fleet_workload import FleetRequest
from everystop.sim.sim_executor import SimClock, SimExecutor
from everystop.sim.simulator import SimSetup

ARRIVAL, PASS = 0, 1  # event kinds: at equal times arrivals go first (the single-node order)
PASS_END = -1  # the token of a pass's end; a pass start carries its replica's wake token
TAKEN, FULL, REJECTED = "taken", "full", "rejected"  # what offer() says of an arrival


@dataclass
class Finished:
    """What is kept of a request once it leaves: its timings, not its tokens."""

    request_id: str
    replica: int
    arrival_s: float
    first_token_s: float | None
    finished_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    priority: int
    tenant: str


@dataclass
class FleetResult:
    finished: list[Finished]
    rejected: dict[str, str]
    num_passes: list[int]  # per replica
    busy_s: list[float]  # per replica
    num_preemptions: int
    end_time_s: float
    num_routed: list[int] = field(default_factory=list)  # per replica


class Replica:
    """One node: the real scheduler over its own KV cache, its passes timed by `latency_fn`."""

    def __init__(self, index: int, setup: SimSetup,
                 latency_fn: Callable[[IterationShape], float]) -> None:
        self.index, self.replica_id = index, f"r{index}"
        self.clock = SimClock(0.0)
        self.latency_fn = latency_fn
        self.kv = KVCacheManager(setup.num_gpu_blocks, setup.block_size,
                                 num_cpu_blocks=setup.num_cpu_blocks,
                                 enable_prefix_caching=setup.enable_prefix_caching,
                                 watermark=setup.watermark)
        self.sched = Scheduler(setup.scheduler, self.kv, cost_model=setup.preemption_cost,
                               clock=self.clock)
        # request id -> the request and what the router was told of it, until it finishes
        self.routed: dict[str, tuple[Request, Any]] = {}  # (request, what on_finished gets)
        self.inbox: list[Request] = []  # arrived during the pass in flight
        self.in_pass: SchedulerOutput | None = None
        self.latency = 0.0
        self.wake_token = 0  # only the newest wake-up (pass start) for this replica counts
        self.wake_at: float | None = None  # when that event is due, if one is pending
        self.stalled = False  # its last attempt scheduled nothing
        self.num_passes, self.busy_s, self.num_routed = 0, 0.0, 0
        self.stretch: DecodeStretch | None = None
        self.stretch_token = PASS_END  # stretch events carry tokens below PASS_END
        self.stretch_at = 0  # the boundary of the stretch's pending event
        # fleet_parallel only: the token of an event whose end is applied and whose
        # continuation waits for the arrivals before it (a pass still in flight to them)
        self.parked: int | None = None

    @property
    def busy(self) -> bool:
        """A pass in flight, or a stretch's planned passes (in its mixed passes it rides
        along the scheduler's, in_pass), or a parked event's continuation."""
        return (self.in_pass is not None or self.parked is not None
                or (self.stretch is not None and not self.stretch.mixed))

    def account(self, latency: float) -> None:
        self.num_passes += 1
        self.busy_s += latency

    def begin(self, decode_stretches: bool) -> tuple[float, int] | None:
        """Start the next work: a decode stretch where one can run, else one pass. The
        (time, token) of the event that ends it, or None if nothing could run."""
        st = self.stretch
        if st is not None:  # in its mixed passes: back to planned passes once all decode
            if st.absorb(len(self.inbox)):
                self.stalled = False
                return self.stretch_event()
        elif decode_stretches and can_stretch(self.sched, len(self.inbox)):
            st = DecodeStretch(self.sched, self.clock, self.latency_fn, self.account)
            if st.ok:
                st.advance(0, start_next=True)
                self.stretch = st
                self.stalled = False
                return self.stretch_event()
        end = self.start_pass()
        return None if end is None else (end, PASS_END)

    def stretch_event(self, boundary: int | None = None) -> tuple[float, int]:
        """The stretch's next visible moment, planned further unless `boundary` is given (a new
        token: the stretch's earlier events become stale)."""
        assert self.stretch is not None
        self.stretch_at = self.stretch.plan() if boundary is None else boundary
        self.stretch_token -= 1
        return self.stretch.times[self.stretch_at], self.stretch_token

    def end_stretch_step(self) -> list[Request]:
        """At the stretch's event: apply its passes up to it; the requests they finished.
        Whether the stretch is over is `stretch_over`'s to say, next (an arrival in the last
        pass may end it in between: fleet_parallel applies a pass end ahead of its arrivals)."""
        st = self.stretch
        assert st is not None
        done = st.advance(self.stretch_at, start_next=False)
        return [self.routed[r.request_id][0] for r in done]

    def stretch_over(self) -> bool:
        """After `end_stretch_step`: whether the stretch is over (then the next pass is the
        scheduler's, with its rows held in bulk in it if any are left)."""
        st = self.stretch
        assert st is not None
        boundary = self.stretch_at
        over = st.end == boundary or st.alive == 0
        if over:
            if st.alive:  # the next passes are the scheduler's, with the rows held in bulk
                st.to_mixed()
            else:
                st.close(boundary)
                self.stretch = None
        # NOTE: the next pass's start is left to the next plan(), which first checks its
        # growth against the pool (the finishes just applied freed blocks; it may still be short).
        return over

    def catch_up(self, before_s: float) -> None:
        """Apply the stretch's passes that ended before `before_s` (a report is due)."""
        st = self.stretch
        if st is not None and not st.mixed:
            b = st.boundaries_before(before_s)
            # b == applied too: a pass start deferred at a finish event (end_stretch_step)
            if b >= st.applied:
                st.advance(b, start_next=True)

    def load(self, seq: int) -> ReplicaLoad:
        s = self.sched
        queued = [r for q in (s.waiting, s.preempted) for r in q]
        return ReplicaLoad(self.replica_id, num_waiting=len(queued) + len(self.inbox),
                           num_running=len(s.running), num_swapped=len(s.swapped),
                           free_kv_blocks=self.kv.pool.num_free_blocks,
                           total_kv_blocks=self.kv.pool.num_blocks,
                           # As a replica reports it (cluster/replica.py): the prompt left to
                           # prefill of queued requests and of running ones still mid-prompt.
                           prefill_tokens_queued=sum(r.num_tokens - r.num_computed_tokens
                                                     for r in queued)
                           + sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                                 for r in s.running)
                           + sum(r.num_prompt_tokens for r in self.inbox), seq=seq)

    def start_pass(self) -> float | None:
        """Schedule a pass now; its end time, or None if nothing could run."""
        out = self.sched.schedule()
        if self.stretch is not None and self.stretch.dead:  # its rows were given back
            self.stretch = None
        if out.is_empty:
            self.stalled = True
            return None
        self.stalled = False
        self.in_pass = out
        self.latency = self.latency_fn(IterationShape.from_scheduler_output(out))
        self.num_passes += 1
        self.busy_s += self.latency
        return self.clock.now + self.latency

    def end_pass(self) -> list[Request]:
        """Apply the pass in flight; the requests it finished."""
        out, self.in_pass = self.in_pass, None
        assert out is not None
        self.clock.advance(self.latency)
        st = self.stretch
        # The bulk rows come first in the pass: their ends before the scheduler's other rows.
        bulk_done = (st.end_mixed(self.latency) if st is not None and out.num_bulk_decodes
                     else [])
        if st is not None and not st.alive:
            self.stretch = None
            self.sched.decode_batch = EAGER_DECODES
        sampled = dict.fromkeys([e.request_id for e in out.scheduled if e.sample],
                                SimExecutor.SAMPLED_TOKEN)
        updates = self.sched.update_from_output(
            out, ModelOutput(sampled_token_ids=sampled, execute_time_s=self.latency))
        routed = self.routed
        return bulk_done + [routed[u.request_id][0] for u in updates
                            if u.finish_reason is not None]


def simulate_fleet_serial(requests: Iterable[FleetRequest], setup: SimSetup,
                          latency_fn: Callable[[IterationShape], float], num_replicas: int,
                          router: Router, *, stats_interval_s: float = 1.0,
                          decode_stretches: bool = True) -> FleetResult:
    """`fleet_run.simulate_fleet` in this process: route `requests` (in arrival order) over
    `num_replicas` simulated replicas."""
    _check_fleet_args(num_replicas, stats_interval_s)
    # The replicas' block tables are hundreds of thousands of objects that live as long as the
    # run, and requests, their hashes and their Finished records pile up as it goes: the cyclic
    # collector is kept off for the run (see _gc_frozen), the building of the block pools
    # included (with it on, its passes over the growing pools tripled their build time).
    with _gc_frozen():
        replicas = [Replica(i, setup, latency_fn) for i in range(num_replicas)]
        want_hashes = isinstance(router, PrefixAffinityRouter)
        refusing = may_refuse(setup.scheduler)
        # (time, kind, replica, seq, token): at equal times and kinds, replica order
        events: list[tuple[float, int, int, int, int]] = []
        seq = 0
        loads: list[ReplicaLoad] = []
        report_seq = 0
        finished: list[Finished] = []
        rejected: dict[str, str] = {}
        source = iter(requests)
        nxt = next(source, None)
        last_arrival = -math.inf
        if nxt is not None:
            events.append((nxt.arrival_s, ARRIVAL, -1, 0, 0))

        def take_reports(before_s: float) -> None:
            nonlocal loads, report_seq
            report_seq += 1
            for r in replicas:
                r.catch_up(before_s)
            loads = [r.load(report_seq) for r in replicas]

        def push(r: Replica, at: float, token: int) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(events, (at, PASS, r.index, seq, token))

        def wake(r: Replica, at: float) -> None:
            r.wake_token += 1
            r.wake_at = at
            push(r, at, r.wake_token)

        def cut(r: Replica, at: float) -> None:
            assert r.stretch is not None
            boundary = r.stretch.cut_at(at)
            if boundary != r.stretch_at:
                push(r, *r.stretch_event(boundary))

        take_reports(0.0)
        report_k = 0  # the grid point of the last report
        now = 0.0
        while events:
            now, kind, index, _, token = heapq.heappop(events)
            if stats_interval_s and now >= (report_k + 1) * stats_interval_s:
                # Nothing changes between events, so the last report due before `now` is the one
                # the router holds now: the grid point's, holding what happened before it.
                report_k = _last_grid_point(now, stats_interval_s)
                take_reports(report_k * stats_interval_s)
            if kind == ARRIVAL:
                assert nxt is not None
                spec = nxt
                if spec.arrival_s < last_arrival:
                    raise ValueError("fleet requests must come in arrival order")
                last_arrival = spec.arrival_s
                nxt = next(source, None)
                if nxt is not None:
                    seq += 1
                    heapq.heappush(events, (nxt.arrival_s, ARRIVAL, -1, seq, 0))
                if not stats_interval_s:
                    take_reports(now)
                _route(spec, replicas, router, loads, rejected, want_hashes, setup.block_size,
                       wake, cut, refusing)
                continue
            _replica_event(replicas[index], token, now, router, finished, rejected,
                           decode_stretches, push, wake)
        return _fleet_result(replicas, finished, rejected, now)


def may_refuse(cfg: SchedulerConfig) -> bool:
    """Whether a replica may refuse an arrival another would take (QueueFull: queue caps are
    configured); without them every replica takes it, or none can ever run it."""
    return bool(cfg.max_queued_per_tenant or any(cfg.max_queued_per_tier))


def _check_fleet_args(num_replicas: int, stats_interval_s: float) -> None:
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, not {num_replicas}")
    if stats_interval_s < 0:
        raise ValueError(f"stats_interval_s must be >= 0, not {stats_interval_s}")


class FinishListener(Protocol):
    """Who hears of a routed request's end: the router, or a worker's outbox to it."""

    def on_finished(self, replica_id: str, request: Any) -> None: ...


def _replica_event(r: Replica, token: int, now: float, router: FinishListener,
                   finished: list[Finished], rejected: dict[str, str], decode_stretches: bool,
                   push: Callable[[Replica, float, int], None],
                   wake: Callable[[Replica, float], None]) -> None:
    """A replica's event at `now`: a pass ends (or a stretch step, or a stale one is dropped),
    or it wakes; then it starts its next pass, or sets the timeout that may unblock it."""
    if end_part(r, token, router, finished):
        continuation(r, token, now, router, rejected, decode_stretches, push, wake)


def end_part(r: Replica, token: int, router: FinishListener, finished: list[Finished]) -> bool:
    """The part of a replica's event that no arrival at its time or before can change: a pass's
    (or stretch step's) end applied, its finishes told. False if the event is stale (a stretch
    step superseded by a cut); a wake-up has no such part."""
    if token == PASS_END:
        done = r.end_pass()
    elif token < PASS_END:
        if token != r.stretch_token:
            return False  # a stretch event superseded by a cut
        done = r.end_stretch_step()
    else:
        return True
    for req in done:
        router.on_finished(r.replica_id, r.routed.pop(req.request_id)[1])
        finished.append(_finished(req, r.index))
    return True


def continuation(r: Replica, token: int, now: float, router: FinishListener,
                 rejected: dict[str, str], decode_stretches: bool,
                 push: Callable[[Replica, float, int], None],
                 wake: Callable[[Replica, float], None]) -> None:
    """The rest of the event, which needs every arrival up to `now` handed over: the arrivals
    queued during the pass join, the next pass or stretch step starts (or a wake-up's)."""
    if token <= PASS_END:
        if token < PASS_END and not r.stretch_over():
            push(r, *r.stretch_event())
            return
        for req in r.inbox:
            _add(r, req, router, rejected)
        r.inbox.clear()
    else:
        if token != r.wake_token or r.busy:
            return  # superseded by an earlier wake-up
        r.wake_at = None
        r.clock.now = max(r.clock.now, now)
    event = r.begin(decode_stretches) if r.sched.has_unfinished else None
    if event is not None:
        push(r, *event)
    elif r.sched.has_unfinished:
        at = _static_timeout(r.sched, r.clock.now)
        if at is not None:
            wake(r, at)


def _fleet_result(replicas: list[Replica], finished: list[Finished], rejected: dict[str, str],
                  now: float) -> FleetResult:
    """The run's result once no event is left (an error if a replica still holds work)."""
    stuck = [r.replica_id for r in replicas if r.sched.has_unfinished]
    if stuck:
        raise RuntimeError(f"replicas {stuck} cannot run anything and no event is pending "
                           "(a request larger than the KV pool?)")
    return FleetResult(finished=finished, rejected=rejected,
                       num_passes=[r.num_passes for r in replicas],
                       busy_s=[r.busy_s for r in replicas],
                       num_preemptions=sum(sum(r.sched.num_preemptions.values())
                                           for r in replicas),
                       end_time_s=max([now] + [r.clock.now for r in replicas]),
                       num_routed=[r.num_routed for r in replicas])


def _last_grid_point(now: float, interval: float) -> int:
    """The largest k with k * interval <= now (computed the same way whatever came before, so
    the report grid does not depend on which events the loop happened to pop)."""
    k = math.floor(now / interval)
    while k * interval > now:
        k -= 1
    while (k + 1) * interval <= now:
        k += 1
    return k


@contextmanager
def _gc_frozen() -> Iterator[None]:
    """No cyclic garbage collection while the fleet runs (reference counting frees as usual).

    The run makes almost no reference cycles (at 2,000 requests x 64 replicas the collector
    found 183 objects in 2,681 passes, none in its full passes; at 20,000 none in 58 full
    passes), but a full pass re-walks every live object, and those grow with the run (finished
    records, the prefix cache's hashes): 13-18% of the CPU of a 20,000-request run at 64
    replicas, 27% at 50,000 (paired runs, as in benchmarks/results/sim/fleet_speed.json). The
    few cycles left are collected once it is back on.

    PyPy has no such collector (no `gc.freeze`): its generational one stays on. Off, it kept
    every dead object of the run (gc.disable stops its major collections: 2.2 GiB resident at
    20,000 requests, against 1.2 GiB on), for no gain in time."""
    if not hasattr(gc, "freeze"):  # PyPy
        yield
        return
    was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


def _route(spec: FleetRequest, replicas: list[Replica], router: Router,
           loads: list[ReplicaLoad], rejected: dict[str, str], want_hashes: bool,
           block_size: int, wake: Callable[[Replica, float], None],
           cut: Callable[[Replica, float], None], refusing: bool) -> None:
    route = route_request(spec.prompt_token_ids, block_size, with_hashes=want_hashes)
    reason = "no replica"
    if refusing:
        choices: Iterable[str] = router.rank(route, loads)
    else:  # only the first choice is ever offered (see may_refuse)
        first = router.best(route, loads)
        choices = () if first is None else (first,)
    for replica_id in choices:
        r = replicas[int(replica_id.removeprefix("r"))]
        outcome, why = offer(r, spec, route, wake, cut)
        if outcome == TAKEN:
            router.on_sent(r.replica_id, route)
            return
        if outcome == REJECTED:  # no replica could ever run it
            rejected[spec.request_id] = why
            return
        reason = why  # QueueFull: the next one
    rejected[spec.request_id] = reason


def offer(r: Replica, spec: FleetRequest, route: object,
          wake: Callable[[Replica, float], None],
          cut: Callable[[Replica, float], None]) -> tuple[str, str]:
    """Hand an arrival to replica `r` at its arrival time: (TAKEN, ""), (FULL, why) on
    QueueFull (the router tries its next choice), or (REJECTED, why) if it can never run
    (RequestRejected). `route` is what `r.routed` keeps for the router's on_finished."""
    req = Request(spec.request_id, spec.prompt_token_ids,
                  SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True),
                  arrival_time=spec.arrival_s, priority=spec.priority, tenant=spec.tenant)
    if r.busy:
        # NOTE: a busy replica queues it until the pass ends (the single-node loop adds
        # arrivals between passes); admission is checked then, so it cannot bounce here.
        r.inbox.append(req)
        if r.stretch is not None and not r.stretch.mixed:
            cut(r, spec.arrival_s)  # the pass it arrives in is the stretch's last
    else:
        try:
            r.sched.add_request(req)
        except QueueFull as exc:
            return FULL, str(exc)  # the router tries the next replica, as the live one does
        except RequestRejected as exc:
            return REJECTED, str(exc)
        if r.wake_at is None or r.wake_at > spec.arrival_s:
            # Idle, or stalled until a later timeout: this arrival wakes it now (a stalled
            # replica's clock has to move, as the single-node loop's does).
            r.clock.now = max(r.clock.now + (1e-9 if r.stalled else 0.0), spec.arrival_s)
            wake(r, r.clock.now)
    r.routed[spec.request_id] = (req, route)
    r.num_routed += 1
    return TAKEN, ""


def _add(r: Replica, req: Request, router: FinishListener, rejected: dict[str, str]) -> None:
    try:
        r.sched.add_request(req)
    except (RequestRejected, QueueFull) as exc:
        rejected[req.request_id] = str(exc)
        router.on_finished(r.replica_id, r.routed.pop(req.request_id)[1])


def _static_timeout(sched: Scheduler, now: float) -> float | None:
    """When a stalled static-batching replica's oldest queued request times out (the only thing
    besides an arrival that can unblock a replica), or None."""
    cfg = sched.config
    queued = [r.arrival_time for q in (sched.waiting, sched.preempted) for r in q]
    if cfg.scheduling != "static" or not queued:
        return None
    return max(now + 1e-9, min(queued) + cfg.static_batch_timeout_s + 1e-9)


def _finished(req: Request, replica: int) -> Finished:
    assert req.finished_time is not None
    return Finished(req.request_id, replica, req.arrival_time, req.first_token_time,
                    req.finished_time, req.num_prompt_tokens, req.num_output_tokens,
                    max(0, req.num_cached_tokens), req.priority, req.tenant)
