"""The routing policies: rank replicas best first from their load reports, corrected between
reports by the router's own count of requests sent and finished.

    least-loaded     lowest (KV tier, score); the design's policy and the default
    prefix-affinity  least-loaded, but the replica that last took the same leading prompt blocks
                     goes first unless its score exceeds the best one's by `affinity_margin`;
                     a prompt no replica holds goes, among equally loaded replicas, to the one
                     holding the fewest prefix blocks
    power-of-two     two replicas drawn at random, the shorter queue first (Ray's built-in idea)
    round-robin      each replica in turn, blind to load
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import islice

from everystop.routing.load import (
    Corrected,
    ReplicaLoad,
    RouteRequest,
    ScoreWeights,
    depth,
    score_parts,
    tier_and_score,
)

POLICIES = ("least-loaded", "prefix-affinity", "power-of-two", "round-robin")
# How much busier (in score units: requests waiting) the replica holding a prompt's prefix may be
# than the least-loaded one and still get it. 4, not 2: on the shared-system-prompt workload in
# the fleet simulator (2 replicas, pools holding about half the prompts) 4 kept more prefixes on
# one replica (hit rate 0.83 vs 0.77 at ~40% load, 0.77 vs 0.71 near saturation) and lowered
# p99 TTFT too, since a hit skips the whole shared prefill.
DEFAULT_AFFINITY_MARGIN = 4.0


@dataclass
class _Books:
    """This router's own account of one replica, to correct its (stale) load report."""

    # Requests sent and not yet finished, in send order, with the report seq seen at sending.
    outstanding: dict[int, tuple[RouteRequest, int]] = field(default_factory=dict)
    seq: int = -1  # the last report seen
    # Requests finished since that report though sent before it: the report still counts them.
    finished: int = 0
    finished_blocks: int = 0
    # Bumped by every send and finish: a cached correction of an unchanged report holds until then.
    version: int = 0
    # The last correction made: (the report, the version it saw, the result, its score_parts).
    cached: tuple[ReplicaLoad, int, Corrected, tuple] | None = None


class Router:
    """Least-loaded ranking; the other policies override `_order`.

    The caller tries `rank()`'s replicas in order (the next on QueueFull), then reports the one
    that took the request with `on_sent` and its end with `on_finished`, passing the same
    `RouteRequest` object both times.

    `reasons` counts why each request sent went where it went: `rank()`'s reason for its first
    choice (`last_reason`, one of the policy's `REASONS`) when the request went there,
    `next_in_rank` when the first refused and a later one took it, or the reason the caller
    gives `on_sent` when something else chose (the Ray router's `ray_placed`).

    Between reports the router corrects each replica's numbers with its own books: requests it
    sent beyond what the report shows are counted as waiting (their prompts as prefill work,
    their blocks as taken), and requests that finished since the report are taken off.
    NOTE: a report may be taken after a send yet not show it (the request is still on its way),
    so a report never wipes the books; only finishes do.
    """

    policy = "least-loaded"
    REASONS: tuple[str, ...] = ("least_loaded",)

    def __init__(self, weights: ScoreWeights | None = None) -> None:
        self.weights = weights or ScoreWeights()
        self._books: dict[str, _Books] = {}
        self._keys: dict[str, tuple[int, float]] = {}  # this rank()'s (tier, score) per replica
        # Why the last rank() put its first replica first; `_order` sets it.
        self.last_reason = self.REASONS[0]
        self._last_pick: tuple[int, str, str] | None = None  # (id(request), first, reason)
        self.reasons: Counter[str] = Counter()  # reason -> requests sent

    def rank(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> list[str]:
        """Replica ids, best first. Every replica in `loads` appears exactly once."""
        corrected = self._score(request, loads)
        self.last_reason = self.REASONS[0]
        ranked = self._order(request, corrected)
        self._last_pick = (id(request), ranked[0], self.last_reason) if ranked else None
        return ranked

    def best(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> str | None:
        """rank(request, loads)[0] (None for no replicas), with rank's side effects, for a
        caller that takes the first choice whenever it can: a fleet without queue caps, where
        no replica refuses what another would take. Least-loaded finds it without sorting."""
        if type(self)._order is not Router._order:
            ranked = self.rank(request, loads)
            return ranked[0] if ranked else None
        self._score(request, loads)
        keys = self._keys
        self.last_reason = self.REASONS[0]
        if not keys:
            self._last_pick = None
            return None
        _, first = min(zip(keys.values(), keys))  # _order's first: least (tier, score, id)
        self._last_pick = (id(request), first, self.last_reason)
        return first

    def _score(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> list[Corrected]:
        """Each replica's (tier, score) for this request into `_keys`; their corrected loads."""
        # NOTE: once per request over every replica (the fleet simulator's hot path at 64
        # replicas): a replica's correction, and the parts of its score that do not depend on
        # the request (score_parts), are redone only when its report or books changed; here
        # each (tier, score) is finished from them as tier_and_score computes it, inline.
        w = self.weights
        need = request.kv_blocks_needed
        per_running = w.running * max(1.0, request.num_prompt_tokens / w.prefill_tokens_per_unit)
        kv_pressure = w.kv_pressure
        books_of = self._books
        corrected: list[Corrected] = []
        self._keys = keys = {}
        for load in loads:
            rid = load.replica_id
            books = books_of.get(rid)
            cached = books.cached if books is not None else None
            if cached is None or cached[1] != books.version or not (  # type: ignore[union-attr]
                    cached[0] is load or cached[0] == load):
                cached = self._correction(load)
            total, free, running, queue_term, prefill_term, high_water = cached[3]
            free_after = free - need
            used = total - free_after
            key = (2 if free_after < 0 else 0 if used <= high_water else 1,
                   queue_term + per_running * running + prefill_term
                   + kv_pressure * min(total, used) / total)
            keys[rid] = key
            corrected.append(cached[2])
        return corrected

    @property
    def last_scores(self) -> dict[str, float]:
        """The score of each replica at the last rank(), for metrics and logs."""
        return {rid: key[1] for rid, key in self._keys.items()}

    def on_sent(self, replica_id: str, request: RouteRequest, reason: str | None = None) -> None:
        """`reason`: the caller's own, when the replica was not this router's pick (Ray's)."""
        books = self._books.setdefault(replica_id, _Books())
        books.outstanding[id(request)] = (request, books.seq)
        books.version += 1
        self.reasons[reason or self.reason_for(replica_id, request)] += 1

    def reason_for(self, replica_id: str, request: RouteRequest) -> str:
        """Why `request` went to `replica_id`, as `reasons` counts it."""
        pick = self._last_pick
        if pick is None or pick[0] != id(request):
            return "unranked"  # sent without a rank() of this request (a caller's own choice)
        return pick[2] if pick[1] == replica_id else "next_in_rank"

    def on_finished(self, replica_id: str, request: RouteRequest) -> None:
        books = self._books.setdefault(replica_id, _Books())
        books.version += 1
        entry = books.outstanding.pop(id(request), None)
        if entry is not None and entry[1] < books.seq:
            # Sent before the last report, so that report most likely still counts it.
            books.finished += 1
            books.finished_blocks += request.kv_blocks_needed

    def in_flight(self, replica_id: str) -> int:
        """Requests this router sent to the replica that have not finished."""
        books = self._books.get(replica_id)
        return len(books.outstanding) if books else 0

    # -- internals -------------------------------------------------------------------------------
    def _order(self, request: RouteRequest, corrected: list[Corrected]) -> list[str]:
        # _least_loaded's order (ids are unique, so the tuples never tie)
        return [rid for _, _, rid in sorted((*key, rid) for rid, key in self._keys.items())]

    def _least_loaded(self, request: RouteRequest, corrected: list[Corrected]) -> list[Corrected]:
        keys = self._keys  # rank()'s (tier, score) of this request on each replica
        return sorted(corrected, key=lambda c: (*keys[c.load.replica_id], c.load.replica_id))

    def _correct(self, load: ReplicaLoad) -> Corrected:
        return self._correction(load)[2]

    def _correction(self, load: ReplicaLoad) -> tuple[ReplicaLoad, int, Corrected, tuple]:
        """The replica's corrected load and its score_parts, as `_Books.cached` keeps them."""
        books = self._books.get(load.replica_id)
        if books is None:
            books = self._books[load.replica_id] = _Books()
        cached = books.cached
        if cached is not None and cached[1] == books.version and (
                cached[0] is load or cached[0] == load):
            return cached
        corrected = self._correct_anew(load, books)
        books.cached = cached = (load, books.version, corrected,
                                 score_parts(corrected, self.weights))
        return cached

    def _correct_anew(self, load: ReplicaLoad, books: _Books) -> Corrected:
        if load.seq != books.seq:
            books.seq, books.finished, books.finished_blocks = load.seq, 0, 0
        running = max(0, load.num_running - books.finished)
        seen = running + load.num_waiting + load.num_swapped
        # The newest sends beyond what the report shows have not reached it yet (taken from
        # the end: a replica has ~100 outstanding, and a send leaves one or two unseen).
        num_unseen = max(0, len(books.outstanding) - seen)
        unseen = ([r for r, _ in islice(reversed(books.outstanding.values()), num_unseen)][::-1]
                  if num_unseen else [])
        free = (load.free_kv_blocks - self._unseen_blocks(books, unseen)
                + books.finished_blocks)
        return Corrected(
            load=load,
            waiting=load.num_waiting + len(unseen),
            running=running,
            free_blocks=min(load.total_kv_blocks, max(0, free)),
            prefill_tokens=load.prefill_tokens_queued + sum(r.num_prompt_tokens for r in unseen))


    def _unseen_blocks(self, books: _Books, unseen: list[RouteRequest]) -> int:
        """KV blocks the requests a report does not show yet will take (`unseen`: the newest
        of `books.outstanding`, oldest first)."""
        return sum(r.kv_blocks_needed for r in unseen)


class PrefixAffinityRouter(Router):
    """Least-loaded, with a prompt's leading blocks kept where they were sent before.

    The table maps each leading-block hash to the replica that last took it (LRU, at most
    `max_prefixes` hashes), and counts the blocks it attributes to each replica: the router's
    view of what each replica's prefix cache holds. A prompt whose blocks no replica holds yet
    goes, among the replicas tied for least loaded, to the one holding the fewest.
    NOTE: without that, ties fell to the first replica id: at low load (replicas idle, so tied)
    every new prefix landed on one replica, which then held more prefixes than its pool could
    keep while the other's cache sat empty, and affinity kept sending them there to be evicted.

    The prefix's replica is scored for what the request adds there: the leading blocks it
    shares with a request this router sent there and has not seen finish are pinned already
    (used in the report, or taken by the in-flight correction), so they are not charged again.
    Likewise the in-flight correction charges requests sent there since the last report the
    blocks they share with each other (or with earlier unfinished sends) once.
    NOTE: charging them again made the replica serving a system prompt look a whole prompt's
    blocks fuller than it would get, past the KV high-water mark under load; the request went
    to the other replica, which then evicted its own prompts for a copy (the routing bench's
    shared-prefix workload simulated at 0.8 and 0.95 load with a bf16-like pass cost, 10 seeds:
    199 of 242 `kv_tier` yields were such requests; hit rate at 0.8 load 0.739 -> 0.829).

    Reasons (`Router.reasons`): `affinity` (the prefix's replica), `margin` (it was busier than
    the best by more than the margin), `kv_tier` (its KV tier was worse), `new_prefix` (no
    replica holds the prompt's first block), `no_prefix` (the prompt has no full block).
    """

    policy = "prefix-affinity"
    REASONS = ("new_prefix", "affinity", "margin", "kv_tier", "no_prefix")

    def __init__(self, weights: ScoreWeights | None = None, *,
                 affinity_margin: float = DEFAULT_AFFINITY_MARGIN,
                 max_prefixes: int = 1 << 16) -> None:
        super().__init__(weights)
        if affinity_margin < 0:
            raise ValueError(f"affinity_margin must be >= 0, got {affinity_margin}")
        self.affinity_margin = affinity_margin
        self.max_prefixes = max_prefixes
        self._owner: OrderedDict[int, str] = OrderedDict()  # block hash -> replica, LRU order
        self.blocks_held: Counter[str] = Counter()  # replica -> hashes `_owner` gives it
        # replica -> block hash -> unfinished requests sent there whose prompt has that block
        self._pinned: dict[str, Counter[int]] = {}

    def on_sent(self, replica_id: str, request: RouteRequest, reason: str | None = None) -> None:
        super().on_sent(replica_id, request, reason)
        self._pinned.setdefault(replica_id, Counter()).update(request.prefix_hashes)
        owner, held = self._owner, self.blocks_held
        for h in request.prefix_hashes:
            before = owner.get(h)
            if before != replica_id:
                if before is not None:
                    held[before] -= 1
                held[replica_id] += 1
            owner[h] = replica_id
            owner.move_to_end(h)
        while len(owner) > self.max_prefixes:
            held[owner.popitem(last=False)[1]] -= 1

    def on_finished(self, replica_id: str, request: RouteRequest) -> None:
        books = self._books.get(replica_id)
        if books is not None and id(request) in books.outstanding:
            pinned = self._pinned[replica_id]
            pinned.subtract(request.prefix_hashes)
            for h in request.prefix_hashes:
                if pinned[h] <= 0:
                    del pinned[h]
        super().on_finished(replica_id, request)

    def _unseen_blocks(self, books: _Books, unseen: list[RouteRequest]) -> int:
        """Each unseen request's blocks less the leading ones an earlier unfinished request on
        the same replica shares (the prefix cache allocates those once)."""
        seen = list(books.outstanding.values())[:len(books.outstanding) - len(unseen)]
        held = {h for r, _ in seen for h in r.prefix_hashes}
        total = 0
        for r in unseen:
            shared = 0
            for h in r.prefix_hashes:
                if h not in held:
                    break
                shared += 1
            total += max(0, r.kv_blocks_needed - shared)
            held.update(r.prefix_hashes)
        return total

    def pinned_blocks(self, replica_id: str, request: RouteRequest) -> int:
        """The request's leading blocks that an unfinished request sent to `replica_id` holds
        (chained hashes: a shared block means every block before it is shared too)."""
        pinned = self._pinned.get(replica_id)
        if not pinned:
            return 0
        n = 0
        for h in request.prefix_hashes:
            if h not in pinned:
                break
            n += 1
        return n

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
            self.last_reason = "new_prefix" if request.prefix_hashes else "no_prefix"
            return [c.load.replica_id for c in self._fewest_held_first(ranked)]
        mine = next(c for c in ranked if c.load.replica_id == owner)
        shared = self.pinned_blocks(owner, request)
        if shared:
            own = replace(request, kv_blocks_needed=max(0, request.kv_blocks_needed - shared))
            self._keys[owner] = tier_and_score(mine, own, self.weights)
            ranked = self._least_loaded(request, corrected)
        best = ranked[0]
        (mine_tier, mine_score), (best_tier, best_score) = (self._keys[mine.load.replica_id],
                                                            self._keys[best.load.replica_id])
        if mine_tier > best_tier:
            self.last_reason = "kv_tier"
        elif mine_score > best_score + self.affinity_margin:
            self.last_reason = "margin"
        else:
            self.last_reason = "affinity"
            ranked.remove(mine)
            ranked.insert(0, mine)
        return [c.load.replica_id for c in ranked]

    def _fewest_held_first(self, ranked: list[Corrected]) -> list[Corrected]:
        """`ranked` with the replicas tied with the first for (tier, score) reordered by the
        prefix blocks they hold, fewest first (then by id, as `_least_loaded` breaks ties)."""
        if len(ranked) < 2:
            return ranked
        keys = self._keys
        first = keys[ranked[0].load.replica_id]
        tied = 1
        while tied < len(ranked) and keys[ranked[tied].load.replica_id] == first:
            tied += 1
        if tied == 1:
            return ranked
        held = self.blocks_held
        return sorted(ranked[:tied], key=lambda c: held[c.load.replica_id]) + ranked[tied:]


class PowerOfTwoRouter(Router):
    policy = "power-of-two"
    REASONS = ("power_of_two",)

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
    REASONS = ("round_robin",)

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


def make_router(policy: str, *, affinity_margin: float = DEFAULT_AFFINITY_MARGIN, seed: int = 0,
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
