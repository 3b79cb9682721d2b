"""The fleet simulation on several processes: the same results as `fleet.simulate_fleet`, with
the replicas' work shared among processes (one per core).

Replicas only meet at the router: a replica's passes depend on nothing but the requests routed
to it, and the router needs, at each arrival, what every replica's events before that arrival
left (the finishes it corrects its books by, and the load report at the last grid point). So
the replicas are dealt into W groups (replica i to group i mod W), each with its own event
queue: group 0 in this process, which also holds the workload, the router and the report grid,
and groups 1..W-1 in forked worker processes. At each arrival every group gets one message:
take the previous arrival (the group holding the replica the router picked), run your events up
to the report's grid point and report, run them up to this arrival; each answers with the
offer's outcome, its load reports and what finished. The router then ranks the arrival. One
round trip per arrival; the groups run in parallel between them, the ranking does not.

Why it gives the one-process results exactly: a group processes its replicas' events in the
serial loop's order (time, then replica index, then push order); events of replicas in
different groups never affect each other; the router's books change only by sends and
finishes, and a finish on one replica commutes with one on another (the books are per
replica); the report the router holds at an arrival is the one at the last grid point before
it, which holds what every event before that point left, whichever event took it. The
finished records are put back in the serial order (event time, then replica index). A test
compares the two runs record by record.

What it gains is bounded by the lockstep: per arrival the slowest group's events, then the
ranking alone. Between two arrivals there are few heavy events (a scheduler pass over a full
batch, a decode stretch opened or closed), and they land on one group or the other.

NOTE: with queue caps configured (QueueFull possible) each offer's outcome is awaited before
the next arrival (a refusal sends the request to the router's next choice at the same time):
a second round trip per arrival.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import math
import multiprocessing
import pickle
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any

from everystop.routing import ReplicaLoad, Router, RouteRequest, route_request
from everystop.routing.policies import PrefixAffinityRouter
from everystop.sim.cost_model import IterationShape
from everystop.sim.fleet import (
    PASS,
    REJECTED,
    TAKEN,
    Finished,
    FleetResult,
    Replica,
    _check_fleet_args,
    _gc_frozen,
    _last_grid_point,
    _replica_event,
    offer,
)
from everystop.sim.fleet_workload import FleetRequest
from everystop.sim.simulator import SimSetup


class _Group:
    """One worker's replicas (every W-th) and their events, driven by the parent's messages."""

    def __init__(self, indices: list[int], setup: SimSetup,
                 latency_fn: Callable[[IterationShape], float],
                 decode_stretches: bool) -> None:
        self.replicas = {i: Replica(i, setup, latency_fn) for i in indices}
        self.decode_stretches = decode_stretches
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.last_event_s = 0.0
        # Since the last message: (event time, replica, record) finished, request ids whose
        # end the router must hear of (finished, or refused when taken from the inbox).
        self.finished: list[tuple[float, int, Finished]] = []
        self.ended: list[str] = []
        self.rejected: dict[str, str] = {}

    # The serial loop's closures, over this group's queue.
    def push(self, r: Replica, at: float, token: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, PASS, r.index, self.seq, token))

    def wake(self, r: Replica, at: float) -> None:
        r.wake_token += 1
        r.wake_at = at
        self.push(r, at, r.wake_token)

    def cut(self, r: Replica, at: float) -> None:
        assert r.stretch is not None
        boundary = r.stretch.cut_at(at)
        if boundary != r.stretch_at:
            self.push(r, *r.stretch_event(boundary))

    def on_finished(self, replica_id: str, route: Any) -> None:
        """The router's hook, as _replica_event calls it: `route` is the request id here."""
        self.ended.append(route)

    def advance(self, until: float) -> None:
        """Process every event strictly before `until` (an arrival at `until` goes first)."""
        events, replicas, finished = self.events, self.replicas, []
        while events and events[0][0] < until:
            now, _, index, _, token = heapq.heappop(events)
            self.last_event_s = now
            _replica_event(replicas[index], token, now, self, finished, self.rejected,
                           self.decode_stretches, self.push, self.wake)
            if finished:
                self.finished.extend((now, index, f) for f in finished)
                finished.clear()

    def loads(self, at: float, seq: int) -> list[ReplicaLoad]:
        for r in self.replicas.values():
            r.catch_up(at)
        return [r.load(seq) for r in self.replicas.values()]

    def step(self, handed: tuple[int, FleetRequest] | None, report_at: float | None,
             report_seq: int, until: float) -> tuple[Any, list[ReplicaLoad] | None, Any]:
        """One message: the arrival `handed` over to one of these replicas (at its arrival
        time, where this group stands), a report at `report_at`, then every event before
        `until`. Returns offer()'s outcome, the reports, and (finished, ended, rejected)."""
        outcome = None
        if handed is not None:
            index, spec = handed
            outcome = offer(self.replicas[index], spec, spec.request_id, self.wake, self.cut)
        loads = None
        if report_at is not None:
            self.advance(report_at)
            loads = self.loads(report_at, report_seq)
        self.advance(until)
        news = (self.finished, self.ended, self.rejected)
        self.finished, self.ended, self.rejected = [], [], {}
        return outcome, loads, news

    def result(self) -> dict[str, Any]:
        rs = self.replicas.values()
        return {"stats": {r.index: (r.num_passes, r.busy_s, r.num_routed) for r in rs},
                "stuck": [r.index for r in rs if r.sched.has_unfinished],
                "preemptions": sum(sum(r.sched.num_preemptions.values()) for r in rs),
                "last_event_s": self.last_event_s,
                "clock_s": max(r.clock.now for r in rs)}


def _serve(conn: Connection, indices: list[int], setup: SimSetup,
           latency_fn: Callable[[IterationShape], float], decode_stretches: bool) -> None:
    """A worker process: build its replicas, then answer the parent's messages until closed."""
    gc.disable()  # as fleet._gc_frozen, for the worker's whole life (see there)
    try:
        group = _Group(indices, setup, latency_fn, decode_stretches)
        conn.send(("ready", None))
        while True:
            msg = conn.recv()
            if msg[0] == "step":
                conn.send(("ok", group.step(*msg[1:])))
            elif msg[0] == "result":
                conn.send(("ok", group.result()))
            else:
                return
    except BaseException as exc:  # the parent raises it
        try:
            pickle.dumps(exc)
            conn.send(("error", exc))
        except Exception:  # one that does not pickle
            conn.send(("error", RuntimeError(traceback.format_exc())))
    finally:
        conn.close()


class _Workers:
    """The groups: group 0 in this process (the parent's cores would idle while it waits),
    groups 1.. in forked worker processes. `send` then `recv` per group; the local group runs
    at its `send`, so send to it last (after the others have their work)."""

    def __init__(self, num_groups: int, num_replicas: int, setup: SimSetup,
                 latency_fn: Callable[[IterationShape], float], decode_stretches: bool) -> None:
        # fork: the workers inherit the setup and the latency function (often a closure)
        # instead of pickling them.
        ctx = multiprocessing.get_context("fork")
        self.num_groups = num_groups
        self.conns: dict[int, Connection] = {}
        self.procs = {}
        for w in range(1, num_groups):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, daemon=True,
                            args=(child, list(range(w, num_replicas, num_groups)), setup,
                                  latency_fn, decode_stretches))
            p.start()
            child.close()
            self.conns[w], self.procs[w] = parent, p
        self.local = _Group(list(range(0, num_replicas, num_groups)), setup, latency_fn,
                            decode_stretches)
        self.local_reply: Any = None
        for w in range(1, num_groups):
            self.recv(w)

    def send(self, w: int, msg: tuple) -> None:
        if w:
            self.conns[w].send(msg)
        elif msg[0] == "step":
            self.local_reply = self.local.step(*msg[1:])
        else:
            self.local_reply = self.local.result()

    def recv(self, w: int) -> Any:
        if not w:
            return self.local_reply
        try:
            kind, payload = self.conns[w].recv()
        except EOFError:
            raise RuntimeError(f"fleet worker {w} died (exit code "
                               f"{self.procs[w].exitcode})") from None
        if kind == "error":
            raise payload
        return payload

    def close(self) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("close",))
        for p in self.procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()


def simulate_fleet_parallel(requests: Iterable[FleetRequest], setup: SimSetup,
                            latency_fn: Callable[[IterationShape], float], num_replicas: int,
                            router: Router, *, stats_interval_s: float = 1.0,
                            decode_stretches: bool = True, workers: int = 2) -> FleetResult:
    """`fleet.simulate_fleet`'s run, its replicas spread over `workers` processes."""
    _check_fleet_args(num_replicas, stats_interval_s)
    if workers < 2:
        raise ValueError(f"workers must be >= 2 for a parallel run, not {workers}")
    cfg = setup.scheduler
    # With queue caps, an offer may be refused and the next replica tried at the same time.
    may_refuse = bool(cfg.max_queued_per_tenant or any(cfg.max_queued_per_tier))
    with _gc_frozen():  # as the one-process run (its group 0 runs here)
        pool = _Workers(min(workers, num_replicas), num_replicas, setup, latency_fn,
                        decode_stretches)
        try:
            return _drive(pool, requests, router, num_replicas, stats_interval_s,
                          setup.block_size, may_refuse)
        finally:
            pool.close()


def _drive(pool: _Workers, requests: Iterable[FleetRequest], router: Router,
           num_replicas: int, stats_interval_s: float, block_size: int,
           may_refuse: bool) -> FleetResult:
    num_workers = pool.num_groups
    want_hashes = isinstance(router, PrefixAffinityRouter)
    routes: dict[str, tuple[str, RouteRequest]] = {}  # request id -> (replica id, route)
    finished: list[tuple[float, int, Finished]] = []
    rejected: dict[str, str] = {}
    loads: list[ReplicaLoad] = [None] * num_replicas  # type: ignore[list-item]
    # The previous arrival, handed over with the next message: (worker, replica, spec, route).
    handed: tuple[int, int, FleetRequest, RouteRequest] | None = None
    report_seq, report_k = 0, 0
    last_arrival = -math.inf

    def exchange(report_at: float | None, until: float) -> None:
        nonlocal handed
        for w in reversed(range(num_workers)):  # the local group (0) last
            give = (handed[1], handed[2]) if handed is not None and handed[0] == w else None
            pool.send(w, ("step", give, report_at, report_seq, until))
        replies = [pool.recv(w) for w in range(num_workers)]
        # The hand-over happened at the previous arrival, before anything in these replies.
        for given, _, _ in replies:
            if given is not None:
                assert handed is not None
                _, index, spec, route = handed
                outcome, why = given
                if outcome == TAKEN:
                    routes[spec.request_id] = (f"r{index}", route)
                    router.on_sent(f"r{index}", route)
                else:  # REJECTED (without queue caps no FULL: see may_refuse)
                    assert outcome == REJECTED, outcome
                    rejected[spec.request_id] = why
        for _, worker_loads, (done, ended, refused) in replies:
            if worker_loads is not None:
                for load in worker_loads:
                    loads[int(load.replica_id.removeprefix("r"))] = load
            finished.extend(done)
            rejected.update(refused)
            for rid in ended:
                router.on_finished(*routes.pop(rid))
        handed = None

    exchange(0.0, 0.0)  # the first report, at time 0
    for spec in requests:
        now = spec.arrival_s
        if now < last_arrival:
            raise ValueError("fleet requests must come in arrival order")
        last_arrival = now
        report_at = None
        if not stats_interval_s:
            report_at = now
        elif now >= (report_k + 1) * stats_interval_s:
            report_k = _last_grid_point(now, stats_interval_s)
            report_at = report_k * stats_interval_s
        if report_at is not None:
            report_seq += 1
        exchange(report_at, now)
        route = route_request(spec.prompt_token_ids, block_size, with_hashes=want_hashes)
        ranked = router.rank(route, loads)
        if not may_refuse:
            index = int(ranked[0].removeprefix("r"))
            handed = (index % num_workers, index, spec, route)
            continue
        _offer_in_turn(pool, spec, route, ranked, router, routes, rejected)
    exchange(None, math.inf)

    for w in reversed(range(num_workers)):
        pool.send(w, ("result",))
    results = [pool.recv(w) for w in range(num_workers)]
    stuck = sorted(i for res in results for i in res["stuck"])
    if stuck:
        raise RuntimeError(f"replicas {[f'r{i}' for i in stuck]} cannot run anything and no "
                           "event is pending (a request larger than the KV pool?)")
    stats = {i: s for res in results for i, s in res["stats"].items()}
    finished.sort(key=lambda e: (e[0], e[1]))  # stable: a replica's own order is kept
    return FleetResult(
        finished=[f for _, _, f in finished], rejected=rejected,
        num_passes=[stats[i][0] for i in range(num_replicas)],
        busy_s=[stats[i][1] for i in range(num_replicas)],
        num_preemptions=sum(res["preemptions"] for res in results),
        end_time_s=max([last_arrival, 0.0] + [res["last_event_s"] for res in results]
                       + [res["clock_s"] for res in results]),
        num_routed=[stats[i][2] for i in range(num_replicas)])


def _offer_in_turn(pool: _Workers, spec: FleetRequest, route: RouteRequest, ranked: list[str],
                   router: Router, routes: dict[str, tuple[str, RouteRequest]],
                   rejected: dict[str, str]) -> None:
    """The router's choices in turn, each answered before the next (QueueFull: the next)."""
    num_workers = pool.num_groups
    reason = "no replica"
    for replica_id in ranked:
        index = int(replica_id.removeprefix("r"))
        w = index % num_workers
        # A step to the arrival's own time: hand it over, run nothing further.
        pool.send(w, ("step", (index, spec), None, 0, spec.arrival_s))
        (outcome, why), _, (done, ended, refused) = pool.recv(w)
        assert not done and not ended and not refused
        if outcome == TAKEN:
            routes[spec.request_id] = (replica_id, route)
            router.on_sent(replica_id, route)
            return
        if outcome == REJECTED:
            rejected[spec.request_id] = why
            return
        reason = why
    rejected[spec.request_id] = reason

