"""The fleet simulation on several processes: the same results as `fleet_run.simulate_fleet`, with
the replicas' work shared among processes (one per core).

Replicas only meet at the router: a replica's passes depend on nothing but the requests routed
to it, and the router needs, at each arrival, what every replica's events before that arrival
left (the finishes it corrects its books by, and the load report at the last grid point). So
the replicas are dealt into W groups (`deal`), each with its own event queue: group 0 in this
process, which also holds the workload, the router and the report grid, and groups 1..W-1 in
forked worker processes. Each arrival sends every group one message: take the previous arrival
(the group holding the replica the router picked), report at the grid point if one is due, and
run your events up to this arrival. Workers answer with what finished and their reports.

Looking ahead: no pass is priced below a floor (`CostModel.min_latency_s`, ~16 ms for a
4xH100/70B replica, while arrivals come every ~2 ms at 64 replicas), and finishes happen only
at pass ends. A pass that ends before `until + floor` started before `until`, so once a group
knows every arrival before `until` it can apply those passes' ends and tell their finishes,
parking the rest of each such event (the queued arrivals joining, the next pass starting)
until its arrivals are known. The parent ranks an arrival as soon as every group has told
every finish before it, so it does not wait for the worker at each arrival (the lockstep this
module used to run, which left two processes no faster than one), only when the worker falls
more than a floor behind; the pipes carry the steps in order meanwhile. A report's grid point
bounds the look-ahead (it holds what every event before it left, nothing after; with a
report at every arrival, `stats_interval_s=0`, nothing is looked ahead).

Why it gives the one-process results exactly: a group processes its replicas' events in the
serial loop's order (time, then replica index, then push order); events of replicas in
different groups never affect each other; a parked event's end is what the serial loop would
do at its time whatever arrives meanwhile (an arrival during the pass waits in the inbox, and
one that cuts a decode stretch cuts it at that very pass: `DecodeStretch.cut_at`); the router's
books change only by sends and finishes, and a finish on one replica commutes with one on
another (the books are per replica); the report the router holds at an arrival is the one at
the last grid point before it. The finished records are put back in the serial order (event
time, then replica index). Tests compare the runs record by record.

NOTE: two cases wait for a group's answer. A request no replica could ever run is refused at
once by an idle replica but queued by a busy one (and refused as it joins, an end the router
hears of then), so the parent asks for that offer's outcome; and with queue caps configured
(QueueFull possible) every offer's outcome is awaited and nothing is looked ahead (a refusal
sends the request to the router's next choice at the same time).
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

from everystop.core.intake import RequestRejected, check_runnable
from everystop.routing import ReplicaLoad, Router, RouteRequest, route_request
from everystop.routing.policies import PrefixAffinityRouter
from everystop.sim.cost_model import CostModel, IterationShape
from everystop.sim.fleet import (
    FULL,
    PASS,
    PASS_END,
    REJECTED,
    TAKEN,
    Finished,
    FleetResult,
    Replica,
    _check_fleet_args,
    _gc_frozen,
    _last_grid_point,
    _replica_event,
    continuation,
    end_part,
    may_refuse,
    offer,
)
from everystop.sim.fleet_workload import FleetRequest
from everystop.sim.simulator import SimSetup

CONTINUE = 0  # the token of a parked event's continuation (wake-ups count from 1)


class _Group:
    """One group's replicas (`deal`) and their events, driven by the parent's messages.

    `ahead_s`: no pass is shorter (the cost model's floor; 0 turns looking ahead off). Told
    every arrival before `until`, the group runs every event before it, and applies the ends of
    the passes that end before `until + ahead_s` (they started before `until`, so no arrival to
    come can change them), parking each one's continuation until its arrivals are known: its
    finishes reach the router that far ahead, so the parent rarely waits for this group."""

    def __init__(self, indices: list[int], setup: SimSetup,
                 latency_fn: Callable[[IterationShape], float],
                 decode_stretches: bool, ahead_s: float, stats_interval_s: float) -> None:
        self.replicas = {i: Replica(i, setup, latency_fn) for i in indices}
        self.decode_stretches = decode_stretches
        self.ahead_s, self.stats_interval_s = ahead_s, stats_interval_s
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = self.last_event_s = 0.0
        self.parked: dict[int, float] = {}  # replica -> its parked continuation's time
        # The parked continuations, in the serial order (their events' places in it).
        self.continuations: list[tuple[float, int, int, int, int]] = []
        # Replicas whose inbox holds a request that will be refused as it joins (an end the
        # router must hear of at that continuation's time, so nothing past it is complete).
        self.doomed: set[int] = set()
        # Since the last collect(): (event time, replica, record) finished, (time, request id)
        # whose end the router must hear of (finished, or refused when taken from the inbox),
        # the refusals' reasons, the outcomes asked for, the load reports (seq, loads).
        self.finished: list[tuple[float, int, Finished]] = []
        self.ended: list[tuple[float, str]] = []
        self.rejected: dict[str, str] = {}
        self.outcomes: list[tuple[str, str, str]] = []
        self.reports: list[tuple[int, list[ReplicaLoad]]] = []

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
        """The router's hook, as the fleet's events call it: `route` is the request id here."""
        self.ended.append((self.now, route))

    def advance(self, until: float, ahead: float) -> None:
        """Every event strictly before `until` (an arrival at `until` goes first), and the end
        parts of those before `ahead` (their continuations parked)."""
        events, waiting, replicas, rejected = (self.events, self.continuations, self.replicas,
                                               self.rejected)
        decode_stretches, push, wake, finished = self.decode_stretches, self.push, self.wake, []
        deferred = []
        while True:
            # The next event in the serial order: a parked continuation now due, or an event.
            if waiting and waiting[0][0] < until and (not events or waiting[0] < events[0]):
                now, _, index, _, _ = heapq.heappop(waiting)
                r = replicas[index]
                self.now = now
                token, r.parked = r.parked, None
                del self.parked[index]
                continuation(r, token, now, self, rejected, decode_stretches, push, wake)  # type: ignore[arg-type]
            elif events and events[0][0] < ahead:
                event = heapq.heappop(events)
                now, _, index, seq, token = event
                r = replicas[index]
                self.now = now
                if now < until:
                    _replica_event(r, token, now, self, finished, rejected, decode_stretches,
                                   push, wake)
                elif token > PASS_END:  # a wake-up is all continuation
                    deferred.append(event)
                    continue
                elif end_part(r, token, self, finished):
                    r.parked = token
                    self.parked[index] = now
                    heapq.heappush(waiting, (now, PASS, index, seq, CONTINUE))
                if finished:
                    self.finished.extend((now, index, f) for f in finished)
                    finished.clear()
            else:
                break
            if now > self.last_event_s:
                self.last_event_s = now
            if self.doomed and not r.inbox:
                self.doomed.discard(index)
        for event in deferred:
            heapq.heappush(events, event)

    def ahead(self, until: float) -> float:
        """How far pass ends can be applied once every arrival before `until` is known: the
        shortest pass past it, and never past the next report's grid point (a report holds
        what the events before it left, and nothing after)."""
        if until == math.inf or not self.ahead_s:
            return until
        grid = self.stats_interval_s
        if not grid:
            return until  # a report at every arrival
        return min(until + self.ahead_s, (_last_grid_point(until, grid) + 1) * grid)

    def progress(self, ahead: float) -> float:
        """Every end the router must hear of before this time has been told."""
        if self.doomed:
            waits = [self.parked[i] for i in self.doomed if i in self.parked]
            if waits:
                return min(ahead, *waits)
        return ahead

    def loads(self, at: float, seq: int) -> list[ReplicaLoad]:
        for r in self.replicas.values():
            r.catch_up(at)
        return [r.load(seq) for r in self.replicas.values()]

    def step(self, handed: tuple[int, FleetRequest, bool, bool] | None,
             report_at: float | None, report_seq: int, until: float) -> float:
        """One message: the arrival `handed` over to one of these replicas (at its arrival
        time, where this group stands; its outcome kept if asked; whether no replica could
        ever run it), a report at `report_at`, then every event before `until` and the pass
        ends before `ahead(until)`. Returns `progress`."""
        if handed is not None:
            index, spec, tell, doomed = handed
            r = self.replicas[index]
            outcome, why = offer(r, spec, spec.request_id, self.wake, self.cut)
            if tell:
                self.outcomes.append((spec.request_id, outcome, why))
            if doomed and outcome == TAKEN:  # queued while busy: refused as it joins
                self.doomed.add(index)
        if report_at is not None:
            self.advance(report_at, report_at)
            self.reports.append((report_seq, self.loads(report_at, report_seq)))
        ahead = self.ahead(until)
        self.advance(until, ahead)
        return self.progress(ahead)

    def collect(self, progress: float) -> tuple:
        """What the parent is told, and forgotten here."""
        news = (self.outcomes, self.reports, self.finished, self.ended, self.rejected,
                progress)
        self.outcomes, self.reports, self.finished, self.ended, self.rejected = [], [], [], [], {}
        return news

    def result(self) -> dict[str, Any]:
        rs = self.replicas.values()
        return {"stats": {r.index: (r.num_passes, r.busy_s, r.num_routed) for r in rs},
                "stuck": [r.index for r in rs if r.sched.has_unfinished],
                "preemptions": sum(sum(r.sched.num_preemptions.values()) for r in rs),
                "last_event_s": self.last_event_s,
                "clock_s": max(r.clock.now for r in rs)}


def _serve(conn: Connection, indices: list[int], setup: SimSetup,
           latency_fn: Callable[[IterationShape], float], decode_stretches: bool,
           ahead_s: float, stats_interval_s: float) -> None:
    """A worker process: build its replicas, then answer the parent's messages until closed.
    Steps that are waiting already are taken together, with one answer for all of them."""
    if hasattr(gc, "freeze"):  # as fleet._gc_frozen, for the worker's whole life (see there)
        gc.disable()
    try:
        group = _Group(indices, setup, latency_fn, decode_stretches, ahead_s, stats_interval_s)
        conn.send(("ready", None))
        while True:
            msg = conn.recv()
            if msg[0] == "step":
                progress = group.step(*msg[1:])
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] != "step":
                        break
                    progress = group.step(*msg[1:])
                conn.send(("ok", group.collect(progress)))
                if msg[0] == "step":
                    continue
            if msg[0] == "result":
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
    groups 1.. in forked worker processes. A step sent to a worker is answered later (`recv`,
    in order; one answer may cover several steps); the local group's at once."""

    def __init__(self, num_groups: int, num_replicas: int, setup: SimSetup,
                 latency_fn: Callable[[IterationShape], float], decode_stretches: bool,
                 ahead_s: float, stats_interval_s: float) -> None:
        # fork: the workers inherit the setup and the latency function (often a closure)
        # instead of pickling them.
        ctx = multiprocessing.get_context("fork")
        self.num_groups = num_groups
        self.group_of = deal(num_replicas, num_groups)
        members = [[i for i, g in enumerate(self.group_of) if g == w] for w in range(num_groups)]
        self.conns: dict[int, Connection] = {}
        self.procs = {}
        for w in range(1, num_groups):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, daemon=True,
                            args=(child, members[w], setup,
                                  latency_fn, decode_stretches, ahead_s, stats_interval_s))
            p.start()
            child.close()
            self.conns[w], self.procs[w] = parent, p
        self.local = _Group(members[0], setup, latency_fn,
                            decode_stretches, ahead_s, stats_interval_s)
        for w in range(1, num_groups):
            self.recv(w)

    def recv(self, w: int) -> Any:
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


# The parent's share of the replicas against a worker's: it also ranks every arrival and
# carries the messages (measured at 64 replicas: its CPU ~1.35x a worker's at equal shares).
LOCAL_SHARE = 0.85


def deal(num_replicas: int, num_groups: int) -> list[int]:
    """Each replica's group: spread evenly through the indices (the router breaks ties by
    index), group 0 (the parent's) with LOCAL_SHARE of a worker's share, the workers in turn."""
    local = LOCAL_SHARE / (LOCAL_SHARE + num_groups - 1)
    groups, worker = [], 0
    for i in range(num_replicas):
        if math.floor((i + 1) * local) > math.floor(i * local):
            groups.append(0)
        else:
            groups.append(1 + worker % (num_groups - 1))
            worker += 1
    if len(set(groups)) < num_groups:  # too few replicas to skew: one each first
        return [i % num_groups for i in range(num_replicas)]
    return groups


def simulate_fleet_parallel(requests: Iterable[FleetRequest], setup: SimSetup,
                            latency_fn: Callable[[IterationShape], float], num_replicas: int,
                            router: Router, *, stats_interval_s: float = 1.0,
                            decode_stretches: bool = True, workers: int = 2) -> FleetResult:
    """`fleet_run.simulate_fleet`'s run, its replicas spread over `workers` processes."""
    _check_fleet_args(num_replicas, stats_interval_s)
    if workers < 2:
        raise ValueError(f"workers must be >= 2 for a parallel run, not {workers}")
    cfg = setup.scheduler
    # With queue caps, an offer may be refused and the next replica tried at the same time,
    # and a queued request refused as it joins: every step is awaited (no looking ahead).
    refusing = may_refuse(cfg)
    ahead_s = 0.0 if refusing else min_pass_latency(latency_fn)
    with _gc_frozen():  # as the one-process run (its group 0 runs here)
        pool = _Workers(min(workers, num_replicas), num_replicas, setup, latency_fn,
                        decode_stretches, ahead_s, stats_interval_s)
        try:
            return _Driver(pool, router, setup, refusing).run(requests, num_replicas,
                                                              stats_interval_s)
        finally:
            pool.close()


def min_pass_latency(latency_fn: Callable[[IterationShape], float]) -> float:
    """No pass is priced below this by `latency_fn` (the cost model's floor), or 0.0 where it
    is not the cost model's own `latency` (nothing is known of it)."""
    owner = getattr(latency_fn, "__self__", None)
    if isinstance(owner, CostModel) and getattr(latency_fn, "__func__", None) is CostModel.latency:
        return owner.min_latency_s()
    return 0.0


class _Driver:
    """The parent's side: the workload, the router, the report grid, and what each group has
    told it so far. An arrival is ranked once every group has told every end before it."""

    def __init__(self, pool: _Workers, router: Router, setup: SimSetup,
                 may_refuse: bool) -> None:
        self.pool, self.router, self.may_refuse = pool, router, may_refuse
        self.setup = setup
        num_groups = pool.num_groups
        self.progress = [-math.inf] * num_groups  # each group's `progress`, as last told
        self.report_seq_got = [0] * num_groups
        self.waiting_outcome: list[str | None] = [None] * num_groups
        self.routes: dict[str, tuple[str, RouteRequest]] = {}  # request id -> replica, route
        self.sent: dict[str, tuple[str, RouteRequest]] = {}  # awaiting their outcome
        self.ends: list[tuple[float, int, str]] = []  # heap: (time, order told, request id)
        self.num_told = 0
        self.finished: list[tuple[float, int, Finished]] = []
        self.rejected: dict[str, str] = {}
        self.loads: list[ReplicaLoad] = []
        self.kv = next(iter(pool.local.replicas.values())).kv  # every replica's pool is alike
        self.last_outcome: tuple[str, str] = ("", "")

    def step(self, w: int, handed: tuple[int, FleetRequest, bool, bool] | None,
             report_at: float | None, report_seq: int, until: float) -> None:
        msg = ("step", handed, report_at, report_seq, until)
        if w:
            self.pool.conns[w].send(msg)
        else:
            local = self.pool.local
            self.take(0, local.collect(local.step(*msg[1:])))

    def take(self, w: int, news: tuple) -> None:
        """A group's answer: outcomes asked for, load reports, finishes, ends, refusals."""
        outcomes, reports, finished, ended, rejected, progress = news
        for rid, outcome, why in outcomes:
            if rid == self.waiting_outcome[w]:
                self.waiting_outcome[w] = None
            replica_id, route = self.sent.pop(rid)
            self.last_outcome = (outcome, why)
            if outcome == TAKEN:
                self.routes[rid] = (replica_id, route)
                self.router.on_sent(replica_id, route)
            elif outcome == REJECTED:  # no replica could ever run it (an idle one said so)
                self.rejected[rid] = why
            # FULL: _offer_in_turn tries the router's next choice
        for seq, loads in reports:
            for load in loads:
                self.loads[int(load.replica_id.removeprefix("r"))] = load
            self.report_seq_got[w] = seq
        self.finished.extend(finished)
        self.rejected.update(rejected)
        for t, rid in ended:
            self.num_told += 1
            heapq.heappush(self.ends, (t, self.num_told, rid))
        self.progress[w] = progress

    def wait(self, until: float, report_seq: int) -> None:
        """Until every group has told every end before `until` (and its report, its outcome),
        then the router hears of those ends."""
        for w in range(1, self.pool.num_groups):
            while (self.progress[w] < until or self.report_seq_got[w] < report_seq
                   or self.waiting_outcome[w] is not None):
                self.take(w, self.pool.recv(w))
        ends, routes, router = self.ends, self.routes, self.router
        while ends and ends[0][0] < until:
            router.on_finished(*routes.pop(heapq.heappop(ends)[2]))

    def is_doomed(self, spec: FleetRequest) -> bool:
        """Whether no replica could ever run it (RequestRejected: the same on every replica,
        whatever its state), by the replicas' own check."""
        try:
            check_runnable(len(spec.prompt_token_ids), spec.max_tokens, spec.priority,
                           self.setup.scheduler, self.kv)
        except RequestRejected:
            return True
        return False

    def run(self, requests: Iterable[FleetRequest], num_replicas: int,
            stats_interval_s: float) -> FleetResult:
        pool, router, num_groups = self.pool, self.router, self.pool.num_groups
        want_hashes = isinstance(router, PrefixAffinityRouter)
        block_size = self.setup.block_size
        self.loads = [None] * num_replicas  # type: ignore[list-item]
        # The previous arrival, handed over with the next message: (group, message part).
        handed: tuple[int, tuple[int, FleetRequest, bool, bool]] | None = None
        report_seq, report_k = 1, 0
        last_arrival = -math.inf
        for w in reversed(range(num_groups)):  # the first report, at time 0
            self.step(w, None, 0.0, report_seq, 0.0)
        self.wait(0.0, report_seq)
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
            for w in reversed(range(num_groups)):  # the local group (0) last
                give = handed[1] if handed is not None and handed[0] == w else None
                self.step(w, give, report_at, report_seq, now)
            handed = None
            self.wait(now, report_seq if report_at is not None else 0)
            route = route_request(spec.prompt_token_ids, block_size, with_hashes=want_hashes)
            if self.may_refuse:
                self._offer_in_turn(spec, route, router.rank(route, self.loads))
                continue
            replica_id = router.best(route, self.loads)
            assert replica_id is not None
            index = int(replica_id.removeprefix("r"))
            w = self.pool.group_of[index]
            if self.is_doomed(spec):  # taken only if that replica is busy: ask
                self.sent[spec.request_id] = (replica_id, route)
                self.waiting_outcome[w] = spec.request_id
                handed = (w, (index, spec, True, True))
            else:
                self.routes[spec.request_id] = (replica_id, route)
                router.on_sent(replica_id, route)
                handed = (w, (index, spec, False, False))
        for w in reversed(range(num_groups)):
            give = handed[1] if handed is not None and handed[0] == w else None
            self.step(w, give, None, 0, math.inf)
        self.wait(math.inf, 0)
        assert not self.ends and not self.sent

        for w in range(1, num_groups):
            pool.conns[w].send(("result",))
        results = [pool.local.result()] + [pool.recv(w) for w in range(1, num_groups)]
        stuck = sorted(i for res in results for i in res["stuck"])
        if stuck:
            raise RuntimeError(f"replicas {[f'r{i}' for i in stuck]} cannot run anything and "
                               "no event is pending (a request larger than the KV pool?)")
        stats = {i: s for res in results for i, s in res["stats"].items()}
        finished = self.finished
        finished.sort(key=lambda e: (e[0], e[1]))  # stable: a replica's own order is kept
        return FleetResult(
            finished=[f for _, _, f in finished], rejected=self.rejected,
            num_passes=[stats[i][0] for i in range(num_replicas)],
            busy_s=[stats[i][1] for i in range(num_replicas)],
            num_preemptions=sum(res["preemptions"] for res in results),
            end_time_s=max([last_arrival, 0.0] + [res["last_event_s"] for res in results]
                           + [res["clock_s"] for res in results]),
            num_routed=[stats[i][2] for i in range(num_replicas)])

    def _offer_in_turn(self, spec: FleetRequest, route: RouteRequest,
                       ranked: list[str]) -> None:
        """The router's choices in turn, each answered before the next (QueueFull: the next).
        Nothing is looked ahead here (may_refuse), so every group has answered every step."""
        reason = "no replica"
        for replica_id in ranked:
            index = int(replica_id.removeprefix("r"))
            w = self.pool.group_of[index]
            self.sent[spec.request_id] = (replica_id, route)
            self.waiting_outcome[w] = spec.request_id
            # A step to the arrival's own time: hand it over, run nothing further.
            self.step(w, (index, spec, True, False), None, 0, spec.arrival_s)
            while self.waiting_outcome[w] is not None:
                news = self.pool.recv(w)
                assert len(news[0]) == 1 and not any(news[1:5])
                self.take(w, news)
            outcome, why = self.last_outcome
            if outcome == FULL:
                reason = why
                continue
            return  # taken, or rejected (take() said so)
        self.rejected[spec.request_id] = reason
