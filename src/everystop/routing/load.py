"""What a replica reports, what the router knows of a new request, and how the two make a
score: the design's queue depth and KV pressure, corrected by the router's own in-flight count.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load report. `seq` grows with every new report from that replica: the
    router's in-flight correction counts what it sent and saw finish since the last `seq`."""

    replica_id: str
    num_waiting: int
    num_running: int
    num_swapped: int
    free_kv_blocks: int
    total_kv_blocks: int
    prefill_tokens_queued: int
    seq: int = 0

    def __post_init__(self) -> None:
        if self.total_kv_blocks <= 0:
            raise ValueError(f"replica {self.replica_id}: total_kv_blocks must be positive")
        if not 0 <= self.free_kv_blocks <= self.total_kv_blocks:
            raise ValueError(f"replica {self.replica_id}: free_kv_blocks "
                             f"{self.free_kv_blocks} outside 0..{self.total_kv_blocks}")


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a new request before any replica has seen it."""

    kv_blocks_needed: int
    prefix_hashes: tuple[int, ...] = ()  # `prefix_block_hashes` of the prompt
    num_prompt_tokens: int = 0


@dataclass(frozen=True)
class ScoreWeights:
    """How much each kind of load delays a new request's first token, in units of one pass's
    prefill budget (`prefill_tokens_per_unit` prompt tokens, the replicas' chunk size).

    Queued prefill dominates: a newcomer's first token waits for every prompt token queued
    ahead of it (FCFS), so a replica chewing through a 1,500-token prompt is ~3 units busier
    than an idle one. A waiting request costs its prompt tokens (counted there) plus a little
    for its own share of a pass. A running request only adds a decode row to each pass, for
    as many passes as the newcomer's own prefill takes: a long prompt avoids a crowded decode
    batch, a short one hardly cares.
    """

    waiting: float = 0.1
    swapped: float = 1.0  # its KV must come back before it runs: memory pressure, a seat
    running: float = 0.02  # per pass of the newcomer's prefill
    prefill_tokens_per_unit: float = 512.0
    kv_pressure: float = 2.0  # times the KV utilisation once this request is admitted
    # Above this utilisation (after admitting the request) a replica counts as "full": it is
    # ranked after every replica with room, whatever the queues, since admitting there means
    # preempting soon. Replicas where the request does not fit at all come last.
    kv_high_water: float = 0.9


@dataclass(frozen=True)
class Corrected:
    """A report plus the router's own sends and finishes since it was taken."""

    load: ReplicaLoad
    waiting: int
    running: int
    free_blocks: int
    prefill_tokens: int


def tier(c: Corrected, request: RouteRequest, w: ScoreWeights) -> int:
    """0: room below the high-water mark; 1: fits but above it; 2: does not fit now."""
    free_after = c.free_blocks - request.kv_blocks_needed
    if free_after < 0:
        return 2
    used_after = c.load.total_kv_blocks - free_after
    return 0 if used_after <= w.kv_high_water * c.load.total_kv_blocks else 1


def score(c: Corrected, request: RouteRequest, w: ScoreWeights) -> float:
    """Lower is better: the work ahead of this request's first token, plus KV pressure once
    it is admitted."""
    total = c.load.total_kv_blocks
    used_after = min(total, total - c.free_blocks + request.kv_blocks_needed)
    own_passes = max(1.0, request.num_prompt_tokens / w.prefill_tokens_per_unit)
    return (w.waiting * c.waiting + w.swapped * c.load.num_swapped
            + w.running * own_passes * c.running
            + c.prefill_tokens / w.prefill_tokens_per_unit + w.kv_pressure * used_after / total)


def tier_and_score(c: Corrected, request: RouteRequest, w: ScoreWeights) -> tuple[int, float]:
    """`(tier(...), score(...))` in one go, the very same numbers (the router's hot path)."""
    load = c.load
    total = load.total_kv_blocks
    free_after = c.free_blocks - request.kv_blocks_needed
    used = total - free_after
    rank = 2 if free_after < 0 else 0 if used <= w.kv_high_water * total else 1
    own_passes = max(1.0, request.num_prompt_tokens / w.prefill_tokens_per_unit)
    return rank, (w.waiting * c.waiting + w.swapped * load.num_swapped
                  + w.running * own_passes * c.running
                  + c.prefill_tokens / w.prefill_tokens_per_unit
                  + w.kv_pressure * min(total, used) / total)


def score_parts(c: Corrected, w: ScoreWeights) -> tuple[int, int, int, float, float, float]:
    """What `tier_and_score(c, request, w)` uses that does not depend on the request, computed
    once per correction: (total blocks, free blocks, running, the queue terms, the prefill term,
    the high-water mark in blocks). `Router.rank` finishes them per request with the same
    operations in the same order: the very same numbers (a test checks it)."""
    load = c.load
    total = load.total_kv_blocks
    return (total, c.free_blocks, c.running,
            w.waiting * c.waiting + w.swapped * load.num_swapped,
            c.prefill_tokens / w.prefill_tokens_per_unit, w.kv_high_water * total)


def depth(c: Corrected) -> int:
    """Requests on the replica (what Ray's power-of-two compares)."""
    return c.waiting + c.running + c.load.num_swapped
