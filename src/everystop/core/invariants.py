"""The scheduler's invariants, checked by tests after every step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from everystop.core.request import RequestStatus

if TYPE_CHECKING:
    from everystop.core.scheduler import Scheduler


def check_scheduler_integrity(sched: Scheduler) -> None:
    """Raise AssertionError if the queues, the request table and the KV pool disagree."""
    groups = {RequestStatus.RUNNING: sched.running, RequestStatus.WAITING: list(sched.waiting),
              RequestStatus.PREEMPTED: list(sched.preempted),
              RequestStatus.SWAPPED: list(sched.swapped)}
    seen: set[str] = set()
    for status, reqs in groups.items():
        for r in reqs:
            if r.status != status:
                raise AssertionError(f"{r.request_id} is {r.status.name} in the {status.name} list")
            if r.request_id in seen:
                raise AssertionError(f"{r.request_id} is in two queues")
            seen.add(r.request_id)
    if seen != set(sched.requests):
        raise AssertionError("the queues and the request table disagree")
    if len(sched.running) > sched.config.max_num_seqs:
        raise AssertionError("more running sequences than max_num_seqs")
    for r in sched.running:
        held = len(sched.kv.req_blocks.get(r.request_id, ()))
        if held < sched.kv.blocks_needed(r.num_computed_tokens):
            raise AssertionError(f"{r.request_id} computed more tokens than its blocks hold")
    for r in sched.swapped:
        if r.request_id not in sched.kv.swapped_blocks:
            raise AssertionError(f"swapped {r.request_id} has no host blocks")
    if sched._padding and not sched.running:
        raise AssertionError("static padding rows outlived their batch")
    sched.kv.check_integrity(set(sched.requests) | {r.request_id for r in sched._padding})
