"""Many simulated replicas behind the production router, on one discrete-event clock.

Each replica is the production `Scheduler` + `KVCacheManager` with its own clock, its passes
timed by the cost model, exactly as `simulator.simulate` drives one node. A request is routed on
arrival by `everystop.routing` (the scoring function the Ray Serve router uses), which sees each
replica's load report as it was at the last refresh (every `stats_interval_s`), corrected by its
own count of requests sent and finished since: the router's information delay.

Events, in time order (ties: reports, then arrivals, then pass starts/ends, then by sequence)::

    report      every replica's ReplicaLoad is taken (the router's next refresh)
    arrival     router.rank -> the first replica that takes it (QueueFull: the next)
    pass start  an idle replica with work schedules a pass; it ends `latency` later
    pass end    update_from_output, finished requests leave (router.on_finished), queued
                arrivals join, the next pass starts at once

A replica busy with a pass keeps arrivals in an inbox until the pass ends, as the single-node
loop does, so with one replica the schedule is identical to `simulate` (a test checks it).
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

from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.outputs import ModelOutput, SchedulerOutput
from everystop.core.request import Request
from everystop.core.scheduler import QueueFull, RequestRejected, Scheduler
from everystop.routing import ReplicaLoad, Router, RouteRequest, prefix_block_hashes
from everystop.routing.policies import PrefixAffinityRouter
from everystop.sampling_params import SamplingParams
from everystop.sim.cost_model import IterationShape
from everystop.sim.fleet_workload import FleetRequest
from everystop.sim.sim_executor import SimClock, SimExecutor
from everystop.sim.simulator import SimSetup

ARRIVAL, PASS = 0, 1  # event kinds: at equal times arrivals go first (the single-node order)
PASS_END = -1  # the token of a pass's end; a pass start carries its replica's wake token


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
        self.routed: dict[str, tuple[Request, RouteRequest]] = {}
        self.inbox: list[Request] = []  # arrived during the pass in flight
        self.in_pass: SchedulerOutput | None = None
        self.latency = 0.0
        self.wake_token = 0  # only the newest wake-up (pass start) for this replica counts
        self.wake_at: float | None = None  # when that event is due, if one is pending
        self.stalled = False  # its last attempt scheduled nothing
        self.num_passes, self.busy_s, self.num_routed = 0, 0.0, 0

    def load(self, seq: int) -> ReplicaLoad:
        s = self.sched
        queued = [r for q in (s.waiting, s.preempted) for r in q]
        return ReplicaLoad(self.replica_id, num_waiting=len(queued) + len(self.inbox),
                           num_running=len(s.running), num_swapped=len(s.swapped),
                           free_kv_blocks=self.kv.pool.num_free_blocks,
                           total_kv_blocks=self.kv.pool.num_blocks,
                           prefill_tokens_queued=sum(r.num_tokens - r.num_computed_tokens
                                                     for r in queued)
                           + sum(r.num_prompt_tokens for r in self.inbox), seq=seq)

    def start_pass(self) -> float | None:
        """Schedule a pass now; its end time, or None if nothing could run."""
        out = self.sched.schedule()
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
        sampled = dict.fromkeys([e.request_id for e in out.scheduled if e.sample],
                                SimExecutor.SAMPLED_TOKEN)
        updates = self.sched.update_from_output(
            out, ModelOutput(sampled_token_ids=sampled, execute_time_s=self.latency))
        return [self.routed[u.request_id][0] for u in updates if u.finished]


def simulate_fleet(requests: Iterable[FleetRequest], setup: SimSetup,
                   latency_fn: Callable[[IterationShape], float], num_replicas: int,
                   router: Router, *, stats_interval_s: float = 1.0) -> FleetResult:
    """Route `requests` (in arrival order) over `num_replicas` simulated replicas.

    `stats_interval_s`: how often the router gets fresh load reports; 0 = at every arrival."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, not {num_replicas}")
    if stats_interval_s < 0:
        raise ValueError(f"stats_interval_s must be >= 0, not {stats_interval_s}")
    replicas = [Replica(i, setup, latency_fn) for i in range(num_replicas)]
    # The replicas' block tables are hundreds of thousands of objects that live as long as the
    # run: kept out of the cyclic collector's full passes (they cost ~5% of the run otherwise).
    with _gc_frozen():
        want_hashes = isinstance(router, PrefixAffinityRouter)
        events: list[tuple[float, int, int, int, int]] = []  # (time, kind, seq, replica, token)
        seq = 0
        loads: list[ReplicaLoad] = []
        report_seq = 0
        finished: list[Finished] = []
        rejected: dict[str, str] = {}
        source = iter(requests)
        nxt = next(source, None)
        last_arrival = -math.inf
        if nxt is not None:
            events.append((nxt.arrival_s, ARRIVAL, 0, -1, 0))

        def take_reports() -> None:
            nonlocal loads, report_seq
            report_seq += 1
            loads = [r.load(report_seq) for r in replicas]

        def wake(r: Replica, at: float) -> None:
            nonlocal seq
            r.wake_token += 1
            r.wake_at = at
            seq += 1
            heapq.heappush(events, (at, PASS, seq, r.index, r.wake_token))

        take_reports()
        next_report = stats_interval_s
        now = 0.0
        while events:
            now, kind, _, index, token = heapq.heappop(events)
            if stats_interval_s and now >= next_report:
                # Nothing changes between events, so the last report due before `now` is the one the
                # router holds now.
                next_report += math.floor((now - next_report) / stats_interval_s) * stats_interval_s
                take_reports()
                next_report += stats_interval_s
            if kind == ARRIVAL:
                assert nxt is not None
                spec = nxt
                if spec.arrival_s < last_arrival:
                    raise ValueError("fleet requests must come in arrival order")
                last_arrival = spec.arrival_s
                nxt = next(source, None)
                if nxt is not None:
                    seq += 1
                    heapq.heappush(events, (nxt.arrival_s, ARRIVAL, seq, -1, 0))
                if not stats_interval_s:
                    take_reports()
                _route(spec, replicas, router, loads, rejected, want_hashes, setup.block_size, wake)
                continue
            r = replicas[index]
            if token != PASS_END:
                if token != r.wake_token or r.in_pass is not None:
                    continue  # superseded by an earlier wake-up
                r.wake_at = None
                r.clock.now = max(r.clock.now, now)
            else:
                for req in r.end_pass():
                    router.on_finished(r.replica_id, r.routed.pop(req.request_id)[1])
                    finished.append(_finished(req, r.index))
                for req in r.inbox:
                    _add(r, req, router, rejected)
                r.inbox.clear()
            end = r.start_pass() if r.sched.has_unfinished else None
            if end is not None:
                seq += 1
                heapq.heappush(events, (end, PASS, seq, r.index, PASS_END))
            elif r.sched.has_unfinished:
                at = _static_timeout(r.sched, r.clock.now)
                if at is not None:
                    wake(r, at)
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


@contextmanager
def _gc_frozen() -> Iterator[None]:
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _route(spec: FleetRequest, replicas: list[Replica], router: Router,
           loads: list[ReplicaLoad], rejected: dict[str, str], want_hashes: bool,
           block_size: int, wake: Callable[[Replica, float], None]) -> None:
    tokens = spec.prompt_token_ids
    route = RouteRequest(kv_blocks_needed=-(-len(tokens) // block_size),
                         prefix_hashes=prefix_block_hashes(tokens, block_size) if want_hashes
                         else (), num_prompt_tokens=len(tokens))
    reason = "no replica"
    for replica_id in router.rank(route, loads):
        r = replicas[int(replica_id.removeprefix("r"))]
        req = Request(spec.request_id, tokens,
                      SamplingParams(max_tokens=spec.max_tokens, temperature=0.0,
                                     ignore_eos=True),
                      arrival_time=spec.arrival_s, priority=spec.priority, tenant=spec.tenant)
        if r.in_pass is not None:
            # NOTE: a busy replica queues it until the pass ends (the single-node loop adds
            # arrivals between passes); admission is checked then, so it cannot bounce here.
            r.inbox.append(req)
        else:
            try:
                r.sched.add_request(req)
            except QueueFull as exc:
                reason = str(exc)
                continue  # the router tries the next replica, as the live one does
            except RequestRejected as exc:
                rejected[spec.request_id] = str(exc)
                return
            if r.wake_at is None or r.wake_at > spec.arrival_s:
                # Idle, or stalled until a later timeout: this arrival wakes it now (a stalled
                # replica's clock has to move, as the single-node loop's does).
                r.clock.now = max(r.clock.now + (1e-9 if r.stalled else 0.0), spec.arrival_s)
                wake(r, r.clock.now)
        r.routed[spec.request_id] = (req, route)
        r.num_routed += 1
        router.on_sent(r.replica_id, route)
        return
    rejected[spec.request_id] = reason


def _add(r: Replica, req: Request, router: Router, rejected: dict[str, str]) -> None:
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
