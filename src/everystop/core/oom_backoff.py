"""After a forward pass ran out of memory: which sequences leave it, the pass without them, and
a cap on sequences per pass so the victims do not come straight back into a pass that cannot fit.

The cap is multiplicative decrease, additive increase: an out-of-memory pass sets it to the
sequences left in the pass that is retried; every `regrow_after_passes` passes that succeed
give one seat back, until max_num_seqs is reached and the cap is lifted. Memory that was short
once because of fragmentation or a transient allocation comes back to full use by itself; a
batch that really does not fit is retried at most log2(batch) times, then runs at its size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from everystop.core.failed_pass import recompute_now, recompute_swapped, with_rows
from everystop.core.outputs import SchedulerOutput
from everystop.core.preemption import victim_rank
from everystop.core.request import RequestStatus
from everystop.core.scheduler_state import SchedulerState


@dataclass
class SeatCap:
    """Sequences a pass may hold after an out-of-memory pass (None: no cap beyond config)."""

    regrow_after_passes: int = 32
    limit: int | None = None
    _passes_since_change: int = 0

    def seats(self, max_num_seqs: int) -> int:
        return max_num_seqs if self.limit is None else min(self.limit, max_num_seqs)

    def lower_to(self, num_seqs: int) -> None:
        self.limit = max(1, num_seqs)
        self._passes_since_change = 0

    def pass_succeeded(self, max_num_seqs: int) -> None:
        if self.limit is None:
            return
        self._passes_since_change += 1
        if self._passes_since_change >= self.regrow_after_passes:
            self._passes_since_change = 0
            self.limit += 1
            if self.limit >= max_num_seqs:
                self.limit = None


class _OomState(SchedulerState, Protocol):
    oom_seat_cap: SeatCap


def shrink_after_oom(sched: _OomState, failed: SchedulerOutput) -> SchedulerOutput | None:
    """The pass to run again instead of `failed`, which ran out of memory, or None when it held
    one sequence (that one cannot run even alone; the caller fails it).

    The lower-ranked half of its sequences (victim_rank, the policy of every preemption) is
    recompute-preempted, blocks freed, and the sequences per pass are capped at the rest
    (SeatCap). Requests whose blocks this pass swapped in or out are recomputed too: the failed
    pass may have left their copies half done."""
    now = sched.clock()
    requests = sched.requests
    live = [requests[e.request_id] for e in failed.scheduled
            if e.request_id in requests
            and requests[e.request_id].status == RequestStatus.RUNNING]
    if len(live) <= 1 and not failed.swapped_in_request_ids:
        return None
    swapped_in = set(failed.swapped_in_request_ids)
    ranked = sorted((r for r in live if r.request_id not in swapped_in),
                    key=lambda r: victim_rank(r, sched.config, now), reverse=True)
    keep = ranked[:(len(ranked) + 1) // 2]
    kept_ids = {r.request_id for r in keep}
    victims = [r for r in live if r.request_id not in kept_ids and r.request_id not in swapped_in]
    for victim in victims:
        recompute_now(sched, victim)
    sched.oom_seat_cap.lower_to(len(keep))
    # The requests whose blocks it swapped are recomputed too (core/failed_pass.py).
    retry = recompute_swapped(sched, failed)
    out = [r.request_id for r in victims]
    return with_rows(retry, [e for e in retry.scheduled if e.request_id not in out],
                     preempted=out)
