"""What a forward pass that raised leaves behind, and the passes that may run in its place.

A failed pass changed no scheduler state: blocks were allocated when it was scheduled, and
`num_computed_tokens` and the prefix-cache registration advance only in update_from_output.
The device is another matter: the pass may have written part of its rows' K/V (rewritten by
any pass that runs those rows again, at the same positions) and part of its swap copies (which
cannot be trusted, nor repeated: a device block swapped out may already hold a new row's K/V).
So every request whose blocks the pass swapped, in or out, is recomputed instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from everystop.core.outputs import ScheduledSequence, SchedulerOutput
from everystop.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from everystop.core.scheduler_state import SchedulerState


def with_rows(sched: SchedulerOutput, rows: Iterable[ScheduledSequence], *,
              preempted: Iterable[str] = ()) -> SchedulerOutput:
    """The pass `sched` with only `rows` (and no swap copies); `preempted` join its
    preempted_request_ids. The token counts are recomputed for the rows kept."""
    rows = list(rows)
    # Decode-shaped rows as PassBuilder counts them: one token, the last one (plus proposals on
    # a speculating row, counted apart), or padding.
    decodes = [e for e in rows
               if e.padding or (e.sample and e.num_tokens - e.num_draft_tokens == 1)]
    num_draft = sum(e.num_draft_tokens for e in decodes)
    return dataclasses.replace(
        sched, scheduled=rows, blocks_to_swap_out=[], blocks_to_swap_in=[],
        swapped_in_request_ids=[],
        preempted_request_ids=list(dict.fromkeys([*sched.preempted_request_ids, *preempted])),
        num_decode_tokens=len(decodes), num_padding_tokens=sum(e.padding for e in decodes),
        num_draft_tokens=num_draft,
        num_prefill_tokens=sum(e.num_tokens for e in rows) - len(decodes) - num_draft)


def recompute_now(sched: SchedulerState, req: Request) -> None:
    """Preempt a running request by recompute, outside schedule(): its blocks are freed and
    it queues to run again from token 0 (counted as any preemption is)."""
    sched.leave_running(req)
    sched.recompute_later(req)
    req.preemption_count += 1
    req.preemption_times.append(sched.clock())
    sched.num_preemptions["recompute"] += 1


def recompute_swapped(sched: SchedulerState, failed: SchedulerOutput) -> SchedulerOutput:
    """After `failed` raised: the requests it swapped in are recompute-preempted, those it
    swapped out are queued for recompute instead of waiting on their host copy, and the pass
    that may run again is returned (without those rows, without swap copies): `failed`
    itself when it had no copies."""
    if not (failed.blocks_to_swap_out or failed.blocks_to_swap_in
            or failed.swapped_in_request_ids):
        return failed
    requests = sched.requests
    swapped_in = set(failed.swapped_in_request_ids)
    for rid in swapped_in:
        req = requests.get(rid)
        if req is not None and req.status == RequestStatus.RUNNING:
            recompute_now(sched, req)
    for rid in failed.preempted_request_ids:  # swapped out by this pass
        req = requests.get(rid)
        if req is not None and req.status == RequestStatus.SWAPPED:
            sched.swapped.remove(req)
            sched.recompute_later(req)
    return with_rows(failed, [e for e in failed.scheduled if e.request_id not in swapped_in],
                     preempted=swapped_in)
