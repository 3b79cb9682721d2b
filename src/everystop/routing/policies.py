"""The routing policies: rank replicas best first from their load reports, corrected between
reports by the router's own count of requests sent and finished.

    least-loaded     lowest (KV tier, score); the design's policy and the default
    prefix-affinity  least-loaded, but the replica that last took the same leading prompt blocks
                     goes first unless its score exceeds the best one's by `affinity_margin`
    power-of-two     two replicas drawn at random, the shorter queue first (Ray's built-in idea)
    round-robin      each replica in turn, blind to load
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from everystop.routing.load import (
    Corrected,
    ReplicaLoad,
    RouteRequest,
    ScoreWeights,
    depth,
    score,
    tier,
)

POLICIES = ("least-loaded", "prefix-affinity", "power-of-two", "round-robin")


@dataclass
class _SinceReport:
    """What this router did to one replica after its last report (`seq`) was taken."""

    seq: int = -1
    sent: dict[int, RouteRequest] = field(default_factory=dict)  # id(request) -> request
    finished: int = 0
    finished_blocks: int = 0


class Router:
    """Least-loaded ranking; the other policies override `_order`.

    The caller tries `rank()`'s replicas in order (the next on QueueFull), then reports the one
    that took the request with `on_sent` and its end with `on_finished`, passing the same
    `RouteRequest` object both times.
    """

    policy = "least-loaded"

    def __init__(self, weights: ScoreWeights | None = None) -> None:
        self.weights = weights or ScoreWeights()
        self._since: dict[str, _SinceReport] = {}
        # The score of each replica at the last rank(), for metrics and logs.
        self.last_scores: dict[str, float] = {}

    def rank(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> list[str]:
        """Replica ids, best first. Every replica in `loads` appears exactly once."""
        corrected = [self._correct(load) for load in loads]
        self.last_scores = {c.load.replica_id: score(c, request, self.weights) for c in corrected}
        return self._order(request, corrected)

    def on_sent(self, replica_id: str, request: RouteRequest) -> None:
        """`replica_id` took `request`: count it until that replica's next report.

        NOTE: "next" is relative to the last report `rank()` saw, so rank before sending."""
        self._since.setdefault(replica_id, _SinceReport()).sent[id(request)] = request

    def on_finished(self, replica_id: str, request: RouteRequest) -> None:
        since = self._since.setdefault(replica_id, _SinceReport())
        if since.sent.pop(id(request), None) is None:
            # Sent before the last report, so that report still counts it as running.
            since.finished += 1
            since.finished_blocks += request.kv_blocks_needed

    def in_flight(self, replica_id: str) -> int:
        """Requests sent since the replica's last report and not yet finished."""
        since = self._since.get(replica_id)
        return len(since.sent) if since else 0

    # -- internals -------------------------------------------------------------------------------
    def _order(self, request: RouteRequest, corrected: list[Corrected]) -> list[str]:
        return [c.load.replica_id for c in self._least_loaded(request, corrected)]

    def _least_loaded(self, request: RouteRequest, corrected: list[Corrected]) -> list[Corrected]:
        w = self.weights
        return sorted(corrected, key=lambda c: (tier(c, request, w), score(c, request, w),
                                                c.load.replica_id))

    def _correct(self, load: ReplicaLoad) -> Corrected:
        since = self._since.setdefault(load.replica_id, _SinceReport())
        if load.seq != since.seq:
            # A new report: what was sent before it is now in its numbers. NOTE: a request sent
            # just before the report was taken may count twice until the next one: an
            # over-estimate that errs towards spreading load, never towards piling it up.
            since.seq, since.finished, since.finished_blocks = load.seq, 0, 0
            since.sent.clear()
        sent = since.sent.values()
        free = (load.free_kv_blocks - sum(r.kv_blocks_needed for r in sent)
                + since.finished_blocks)
        return Corrected(
            load=load,
            waiting=load.num_waiting + len(since.sent),
            running=max(0, load.num_running - since.finished),
            free_blocks=min(load.total_kv_blocks, max(0, free)),
            prefill_tokens=load.prefill_tokens_queued + sum(r.num_prompt_tokens for r in sent))


class PrefixAffinityRouter(Router):
    policy = "prefix-affinity"

    def __init__(self, weights: ScoreWeights | None = None, *, affinity_margin: float = 2.0,
                 max_prefixes: int = 1 << 16) -> None:
        super().__init__(weights)
        if affinity_margin < 0:
            raise ValueError(f"affinity_margin must be >= 0, got {affinity_margin}")
        self.affinity_margin = affinity_margin
        self.max_prefixes = max_prefixes
        self._owner: OrderedDict[int, str] = OrderedDict()  # block hash -> replica, LRU order

    def on_sent(self, replica_id: str, request: RouteRequest) -> None:
        super().on_sent(replica_id, request)
        for h in request.prefix_hashes:
            self._owner[h] = replica_id
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_prefixes:
            self._owner.popitem(last=False)

    def affinity(self, request: RouteRequest, replica_ids: set[str]) -> str | None:
        """The replica that last took the longest run of this prompt's leading blocks."""
        for h in reversed(request.prefix_hashes):
            owner = self._owner.get(h)
            if owner in replica_ids:
                return owner
        return None

    def _order(self, request: RouteRequest, corrected: list[Corrected]) -> list[str]:
        ranked = self._least_loaded(request, corrected)
        owner = self.affinity(request, {c.load.replica_id for c in ranked})
        if owner is None:
            return [c.load.replica_id for c in ranked]
        best = ranked[0]
        mine = next(c for c in ranked if c.load.replica_id == owner)
        w = self.weights
        if (tier(mine, request, w) <= tier(best, request, w)
                and score(mine, request, w) <= score(best, request, w) + self.affinity_margin):
            ranked.remove(mine)
            ranked.insert(0, mine)
        return [c.load.replica_id for c in ranked]


class PowerOfTwoRouter(Router):
    policy = "power-of-two"

    def __init__(self, weights: ScoreWeights | None = None, *, seed: int = 0) -> None:
        super().__init__(weights)
        self._rng = random.Random(seed)

    def _order(self, request: RouteRequest, corrected: list[Corrected]) -> list[str]:
        shuffled = list(corrected)
        self._rng.shuffle(shuffled)
        # Ray's built-in: of two random replicas, the one with fewer requests; then the others.
        first_two = sorted(shuffled[:2], key=depth)
        return [c.load.replica_id for c in first_two + shuffled[2:]]


class RoundRobinRouter(Router):
    policy = "round-robin"

    def __init__(self, weights: ScoreWeights | None = None) -> None:
        super().__init__(weights)
        self._turn = 0

    def _order(self, request: RouteRequest, corrected: list[Corrected]) -> list[str]:
        ids = sorted(c.load.replica_id for c in corrected)
        if not ids:
            return []
        start = self._turn % len(ids)
        self._turn += 1
        return ids[start:] + ids[:start]


def make_router(policy: str, *, affinity_margin: float = 2.0, seed: int = 0,
                weights: ScoreWeights | None = None) -> Router:
    """One router per policy name in `POLICIES`."""
    if policy == "least-loaded":
        return Router(weights)
    if policy == "prefix-affinity":
        return PrefixAffinityRouter(weights, affinity_margin=affinity_margin)
    if policy == "power-of-two":
        return PowerOfTwoRouter(weights, seed=seed)
    if policy == "round-robin":
        return RoundRobinRouter(weights)
    raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
