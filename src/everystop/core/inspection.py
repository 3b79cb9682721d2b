"""Reading a scheduler from outside without changing it: the invariants tests assert after
every step, and the stats snapshot the engine and /metrics read."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from everystop.core.outputs import SchedulerStats
from everystop.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from everystop.core.scheduler_state import SchedulerState


def check_scheduler_integrity(sched: SchedulerState) -> None:
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
    window = sched.kv.window
    for r in sched.running:
        held = len(sched.kv.req_blocks.get(r.request_id, ()))
        if held < sched.kv.blocks_needed(r.num_computed_tokens):
            raise AssertionError(f"{r.request_id} computed more tokens than its blocks hold")
        released = held - sched.kv.num_held_blocks(r.request_id)
        if window is not None and released < window.first_live_block(
                r.num_computed_tokens - sched.padding_lag):
            raise AssertionError(f"{r.request_id} holds blocks its window has passed")
    for r in sched.swapped:
        host = sched.kv.swapped_blocks.get(r.request_id)
        if host is None:
            raise AssertionError(f"swapped {r.request_id} has no host blocks")
        # Copied: the blocks holding its computed tokens, less those its window released.
        live = (sched.kv.blocks_needed(r.num_computed_tokens)
                - sched.kv.num_released_blocks(r.request_id))
        if len(host) != max(0, live):
            raise AssertionError(f"swapped {r.request_id} has {len(host)} host blocks for "
                                 f"{live} live computed blocks")
    waiting_by_tenant: dict[str, int] = {}
    for r in sched.waiting:
        waiting_by_tenant[r.tenant] = waiting_by_tenant.get(r.tenant, 0) + 1
    queued = sched.queued_counts
    if queued.by_tenant != waiting_by_tenant or set(queued.tenant_drain) != set(waiting_by_tenant):
        raise AssertionError("the per-tenant queue counts disagree with the waiting queue")
    if sched.padding_rows and not sched.running:
        raise AssertionError("static padding rows outlived their batch")
    sched.kv.check_integrity(set(sched.requests) | {r.request_id for r in sched.padding_rows})


def scheduler_stats(sched: SchedulerState) -> SchedulerStats:
    """The scheduler's queues, KV pool and counters now."""
    kv, pool = sched.kv, sched.kv.pool
    return SchedulerStats(
        num_running=len(sched.running), num_waiting=len(sched.waiting) + len(sched.preempted),
        num_swapped=len(sched.swapped), num_free_blocks=pool.num_free_blocks,
        num_used_blocks=pool.num_used_blocks, num_total_blocks=pool.num_blocks,
        kv_usage=pool.usage(), prefix_queries=kv.num_prefix_queries,
        prefix_hits=kv.num_prefix_hits,
        prefix_query_tokens=kv.num_prefix_query_tokens,
        prefix_hit_tokens=kv.num_prefix_hit_tokens,
        num_preemptions_recompute=sched.num_preemptions["recompute"],
        num_preemptions_swap=sched.num_preemptions["swap"],
        swap_out_blocks=sched.num_swap_out_blocks, swap_in_blocks=sched.num_swap_in_blocks,
        prefill_budget_tokens=sched.last_prefill_budget_tokens,
        step_cost=sched.step_cost.coefficients.to_dict(),
        step_predicted_s=sched.step_cost.last_predicted_s,
        step_measured_s=sched.step_cost.last_measured_s,
        auto_tpot_target_s=sched.auto_tpot_target_s,
        spec_decode_num_drafts=sched.num_drafts,
        spec_decode_num_draft_tokens=sched.num_draft_tokens,
        spec_decode_num_accepted_tokens=sched.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=list(sched.num_accepted_tokens_per_pos),
        spec_decode_num_sized_off=sched.spec_sizer.num_sized_off,
        spec_decode_sized_rows=sched.spec_sizer.last_num_rows,
        spec_decode_sized_proposals=sched.spec_sizer.last_num_proposals,
        num_host_used_blocks=kv.num_swapped_blocks, num_host_blocks=kv.num_cpu_blocks,
        running_lora_adapters=_adapter_names(sched.running) if sched.serves_lora else (),
        waiting_lora_adapters=_adapter_names([*sched.waiting, *sched.preempted])
        if sched.serves_lora else (),
        max_loras=sched.config.max_loras)


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))
