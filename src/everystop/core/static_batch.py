"""The static-batching baseline's pass: admit a whole batch only when nothing runs, then run it
to completion (finished members kept as padding rows until it drains, as a batch tensor would).

Part of `Scheduler.schedule()` (scheduling="static"), kept beside it so that the continuous
scheduler reads alone; it uses the scheduler's own admission primitives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from everystop.core.pass_builder import PassBuilder
from everystop.core.request import RequestStatus

if TYPE_CHECKING:
    from everystop.core.scheduler_state import SchedulerState


def schedule_static(sched: SchedulerState, step: PassBuilder) -> None:
    """Fill `step` for the static baseline: the running batch's next tokens, or a new batch."""
    cfg, now, kv = sched.config, step.now, sched.kv
    if sched.running:
        for req in list(sched.running):
            if req.status == RequestStatus.RUNNING and sched.grow(req, 1, step):
                sched.emit(step, req, 1)
        for req in sched.padding_rows:
            step.emit_padding(req, kv.block_ids(req.request_id))
        return
    queued = len(sched.preempted) + len(sched.waiting)
    if not queued:
        return
    oldest = min(r.arrival_time for q in (sched.preempted, sched.waiting) for r in q)
    if queued < cfg.max_batch_size and now - oldest < cfg.static_batch_timeout_s:
        return  # keep the doors shut until the batch is full or the timeout expires
    limit = min(cfg.max_batch_size, sched.num_seats)
    for queue in (sched.preempted, sched.waiting):
        while queue and len(sched.running) < limit:
            req = queue.peek()
            computed = kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
            n = req.num_tokens - req.num_computed_tokens - len(computed) * kv.block_size
            if not kv.allocate(req, n, computed, reserve_watermark=True):
                return
            sched.start_running(queue.pop(), computed, step)
            sched.emit(step, req, n)
