"""The iteration-level scheduler: decides, for every forward pass, which tokens run.

Each `schedule()` builds one pass under one token budget (max_num_batched_tokens):

  1. one decode token for every running sequence that has finished its prompt - first and
     unconditionally (if the pool is short, a lower-ranked sequence is preempted, never skipped);
  2. prefill chunks for running sequences still working through their prompt;
  3. resumed sequences (swapped in from host, then recompute-preempted), ahead of
  4. new admissions, in priority-with-aging then arrival order, while sequence count, budget and
     KV blocks above the watermark allow.

There is no prefill phase and decode phase: each request has `num_computed_tokens` and the
scheduler hands out tokens so that it catches up. `update_from_output()` applies what the
executor sampled, finishes requests (freeing their blocks at once) and reports per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from everystop.config import SchedulerConfig
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.outputs import ModelOutput, RequestUpdate, ScheduledSequence, SchedulerOutput
from everystop.core.preemption import (PreemptionCostModel, choose_strategy, is_protected,
                                       victim_rank)
from everystop.core.request import Request, RequestStatus
from everystop.core.request_queue import RequestQueue


class RequestRejected(ValueError):
    """The request can never run on this engine (too long for the model or the KV pool)."""


class QueueFull(Exception):
    """Backpressure: the tenant's or tier's queue is at its cap; retry later."""

    def __init__(self, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_used_blocks: int
    num_total_blocks: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    swap_out_blocks: int
    swap_in_blocks: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, *,
                 cost_model: PreemptionCostModel | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv = kv
        self.cost_model = cost_model or PreemptionCostModel()
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting = RequestQueue(config.aging_interval_s)
        self.preempted = RequestQueue(config.aging_interval_s)
        self.swapped = RequestQueue(config.aging_interval_s)
        self._queued_by_tenant: dict[str, int] = {}
        self._queued_by_tier: dict[int, int] = {}
        self._finished_ids: list[str] = []
        # Static padding: finished members of the running static batch, holding their blocks.
        self._padding: list[Request] = []
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_swap_out_blocks = 0
        self.num_swap_in_blocks = 0
        self.num_steps = 0
        # Per-step working state (valid during schedule()).
        self._budget = 0
        self._decodes: dict[str, ScheduledSequence] = {}
        self._prefills: dict[str, ScheduledSequence] = {}
        self._admitted_now: set[str] = set()

    # -- intake ---------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request, or raise RequestRejected / QueueFull right away."""
        cfg = self.config
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty")
        if req.max_total_tokens > cfg.max_model_len:
            raise RequestRejected(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                f"({req.sampling_params.max_tokens}) exceeds max_model_len ({cfg.max_model_len})")
        usable = self.kv.num_gpu_blocks - self.kv.watermark_blocks
        if self.kv.blocks_needed(req.max_total_tokens) > usable:
            raise RequestRejected(
                f"the request needs up to {self.kv.blocks_needed(req.max_total_tokens)} KV blocks "
                f"but the pool has {usable}")
        if not cfg.enable_chunked_prefill and req.num_prompt_tokens > cfg.max_num_batched_tokens:
            raise RequestRejected(
                f"prompt ({req.num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}) and chunked prefill is off")
        if not 0 <= req.priority <= 2:
            raise RequestRejected(f"priority must be 0, 1 or 2, not {req.priority}")
        tenant_cap, tier_cap = cfg.max_queued_per_tenant, cfg.max_queued_per_tier[req.priority]
        if tenant_cap and self._queued_by_tenant.get(req.tenant, 0) >= tenant_cap:
            raise QueueFull(f"tenant {req.tenant!r} has {tenant_cap} requests queued")
        if tier_cap and self._queued_by_tier.get(req.priority, 0) >= tier_cap:
            raise QueueFull(f"priority tier {req.priority} has {tier_cap} requests queued")
        if req.arrival_time == 0.0:
            req.arrival_time = self.clock()
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.push(req)
        self._count_queued(req, +1)

    def _count_queued(self, req: Request, delta: int) -> None:
        self._queued_by_tenant[req.tenant] = self._queued_by_tenant.get(req.tenant, 0) + delta
        self._queued_by_tier[req.priority] = self._queued_by_tier.get(req.priority, 0) + delta

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request for a reason only the engine can see (a stop string)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, status)

    def update_config(self, config: SchedulerConfig) -> None:
        """Hot reload: takes effect at the next schedule()."""
        self.config = config
        for queue in (self.waiting, self.preempted, self.swapped):
            queue.reorder(config.aging_interval_s)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- scheduling -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self.num_steps += 1
        self.kv.begin_step()
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        self._budget = self.config.max_num_batched_tokens
        self._decodes, self._prefills, self._admitted_now = {}, {}, set()

        if self._padding and self.config.scheduling != "static":  # switched at run time
            self._release_padding()
        while len(self.running) > self.config.max_num_seqs:  # max_num_seqs lowered at runtime
            self._preempt(min(self.running, key=lambda r: victim_rank(r, self.config, now)),
                          now, out)
        if self.config.scheduling == "static":
            self._schedule_static(now, out)
        else:
            self._schedule_running(now, out)
            self._admit_swapped(now, out)
            self._admit(self.preempted, now, out)
            self._admit(self.waiting, now, out)

        out.scheduled = list(self._decodes.values()) + list(self._prefills.values())
        out.num_decode_tokens = len(self._decodes)
        out.num_padding_tokens = sum(e.padding for e in self._decodes.values())
        out.num_prefill_tokens = sum(e.num_tokens for e in self._prefills.values())
        self.num_swap_out_blocks += len(out.blocks_to_swap_out)
        self.num_swap_in_blocks += len(out.blocks_to_swap_in)
        return out

    def _schedule_running(self, now: float, out: SchedulerOutput) -> None:
        # 1. Decodes first: a skipped decode stalls that stream for a whole iteration.
        for req in list(self.running):
            if req.status == RequestStatus.RUNNING and req.num_tokens - req.num_computed_tokens == 1:
                if self._grow(req, 1, now, out):
                    self._emit(req, 1)
        # 2. Then the rest of the prompt of sequences already admitted, in admission order.
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or req.request_id in self._decodes:
                continue
            n = self._prefill_size(req.num_tokens - req.num_computed_tokens)
            if n and self._grow(req, n, now, out):
                self._emit(req, n)

    def _schedule_static(self, now: float, out: SchedulerOutput) -> None:
        """Baseline: admit a whole batch only when nothing runs, then run it to completion."""
        cfg = self.config
        if self.running:
            for req in list(self.running):
                if req.status == RequestStatus.RUNNING and self._grow(req, 1, now, out):
                    self._emit(req, 1)
            for req in self._padding:
                self._emit_padding(req)
            return
        queued = len(self.preempted) + len(self.waiting)
        if not queued:
            return
        oldest = min(r.arrival_time for q in (self.preempted, self.waiting) for r in q)
        if queued < cfg.max_batch_size and now - oldest < cfg.static_batch_timeout_s:
            return  # keep the doors shut until the batch is full or the timeout expires
        limit = min(cfg.max_batch_size, cfg.max_num_seqs)
        for queue in (self.preempted, self.waiting):
            while queue and len(self.running) < limit:
                req = queue.peek()
                computed = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
                n = req.num_tokens - req.num_computed_tokens - len(computed) * self.kv.block_size
                if not self.kv.allocate(req, n, computed, reserve_watermark=True):
                    return
                self._start_running(queue.pop(), computed, now)
                self._emit(req, n)

    def _emit_padding(self, req: Request) -> None:
        pos = req.num_computed_tokens - 1
        rid = req.request_id + "#padding"
        self._decodes[rid] = ScheduledSequence(
            request_id=rid, token_ids=req.token_slice(pos, pos + 1), start_pos=pos,
            block_ids=self.kv.block_ids(req.request_id), sample=False,
            sampling_params=req.sampling_params, padding=True)
        self._budget -= 1

    def _leave_running(self, req: Request) -> None:
        self.running.remove(req)
        if not self.running and self._padding:
            self._release_padding()  # the static batch has drained: nobody is left to pad for

    def _release_padding(self) -> None:
        for req in self._padding:
            self.kv.forget(req)
        self._padding.clear()

    def _prefill_size(self, remaining: int) -> int:
        if self._budget <= 0 or remaining <= 0:
            return 0
        if self.config.enable_chunked_prefill:
            return min(remaining, self.config.chunk_size, self._budget)
        if remaining <= self._budget or not (self._decodes or self._prefills):
            return remaining  # whole prompts only; one oversized prompt may run alone
        return 0

    def _admit_swapped(self, now: float, out: SchedulerOutput) -> None:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            req = self.swapped.peek()
            n = self._prefill_size(req.num_tokens - req.num_computed_tokens)
            if not n or not self.kv.can_swap_in(req, n):
                return
            self.swapped.pop()
            out.blocks_to_swap_in.extend(self.kv.swap_in(req, n))
            self._set_running(req, now)
            self._emit(req, n)

    def _admit(self, queue: RequestQueue, now: float, out: SchedulerOutput) -> None:
        while queue:
            req = queue.peek()
            if len(self.running) >= self.config.max_num_seqs and not self._preempt_worse_tier(
                    req, now, out):
                return
            computed = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
            n = self._prefill_size(req.num_tokens - len(computed) * self.kv.block_size)
            if not n:
                return
            while not self.kv.allocate(req, n, computed, reserve_watermark=True):
                if not self._preempt_worse_tier(req, now, out):
                    return  # head-of-line waits: lower tiers may not jump ahead of it
            self._start_running(queue.pop(), computed, now)
            self._emit(req, n)

    def _start_running(self, req: Request, computed: list, now: float) -> None:
        if req.status == RequestStatus.WAITING:
            self._count_queued(req, -1)
        req.num_computed_tokens = len(computed) * self.kv.block_size
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        if req.admitted_time is None:
            req.admitted_time = now
        self._set_running(req, now)

    def _set_running(self, req: Request, now: float) -> None:
        req.status = RequestStatus.RUNNING
        req.last_admitted_time = now
        self.running.append(req)
        self._admitted_now.add(req.request_id)

    def _emit(self, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        entry = ScheduledSequence(
            request_id=req.request_id, token_ids=req.token_slice(start, start + n),
            start_pos=start, block_ids=self.kv.block_ids(req.request_id),
            sample=start + n == req.num_tokens, sampling_params=req.sampling_params,
            output_index=req.num_output_tokens, is_prefill=start < req.num_prompt_tokens)
        is_decode = n == 1 and start == req.num_tokens - 1
        (self._decodes if is_decode else self._prefills)[req.request_id] = entry
        self._budget -= n

    # -- preemption -----------------------------------------------------------------------------
    def _grow(self, req: Request, n: int, now: float, out: SchedulerOutput) -> bool:
        """Make room for n more tokens of a running request, preempting lower-ranked sequences
        if the pool is short. If nothing ranks below it, the request itself is preempted
        (False). NOTE: the ranking is a total order, so the top-ranked sequence always makes
        progress - the engine cannot deadlock on KV memory."""
        if self.kv.allocate(req, n):
            return True
        rank = victim_rank(req, self.config, now)
        while not self.kv.allocate(req, n):
            victims = [r for r in self.running if r is not req
                       and r.request_id not in self._admitted_now
                       and victim_rank(r, self.config, now) < rank]
            if not victims:
                self._preempt(req, now, out)
                return False
            self._preempt(min(victims, key=lambda r: victim_rank(r, self.config, now)), now, out)
        return True

    def _preempt_worse_tier(self, req: Request, now: float, out: SchedulerOutput) -> bool:
        """Free a seat or blocks for a waiting request by preempting a running one of a strictly
        lower tier (never a protected one, never one admitted this step)."""
        victims = [r for r in self.running if r.priority > req.priority
                   and r.request_id not in self._admitted_now
                   and not is_protected(r, self.config, now)]
        if not victims:
            return False
        self._preempt(min(victims, key=lambda r: victim_rank(r, self.config, now)), now, out)
        return True

    def _preempt(self, victim: Request, now: float, out: SchedulerOutput) -> None:
        entry = self._decodes.pop(victim.request_id, None) or self._prefills.pop(
            victim.request_id, None)
        if entry is not None:
            self._budget += entry.num_tokens
        self._leave_running(victim)
        num_blocks = len(self.kv.req_blocks.get(victim.request_id, ()))
        can_swap = (self.kv.can_swap_out(victim)
                    and len(self.swapped) < self.config.max_swapped_seqs)
        strategy = choose_strategy(victim, num_blocks, self.config, self.cost_model, can_swap, now)
        if strategy == "swap":
            out.blocks_to_swap_out.extend(self.kv.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            victim.num_preemptions_swap += 1
            self.swapped.push(victim)
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            victim.num_preemptions_recompute += 1
            self.preempted.push(victim)
        victim.preemption_count += 1
        victim.preemption_times.append(now)
        self.num_preemptions[strategy] += 1
        out.preempted_request_ids.append(victim.request_id)

    # -- results --------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelOutput) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        now = self.clock()
        for entry in sched.scheduled:
            req = self.requests.get(entry.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the pass ran
            req.num_computed_tokens = entry.start_pos + entry.num_tokens
            self.kv.cache_computed_blocks(req)
            if not entry.sample:
                continue
            token = result.sampled_token_ids[entry.request_id]
            req.output_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            update = RequestUpdate(req.request_id, [token])
            lp = result.logprobs.get(entry.request_id)
            if lp is not None:
                update.new_logprobs.append(lp)
            status = self._stop_status(req, token)
            if status is not None:
                if status == RequestStatus.FINISHED_STOPPED:
                    update.stop_token_id = token
                self._finish(req, status)
                update.finish_reason = status.finish_reason
            updates.append(update)
        return updates

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if not params.ignore_eos and token == req.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Free the request's blocks and slot now, whatever state it was in (a static batch
        member with padding on keeps its blocks as a padding row until the batch drains)."""
        keep_as_padding = False
        if req.status == RequestStatus.RUNNING:
            self._leave_running(req)
            keep_as_padding = (self.config.scheduling == "static" and self.config.static_padding
                               and bool(self.running) and req.num_computed_tokens > 0)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
            self._count_queued(req, -1)
        elif req.status == RequestStatus.PREEMPTED:
            self.preempted.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        req.status = status
        req.finished_time = self.clock()
        if keep_as_padding:
            self._padding.append(req)
        else:
            self.kv.forget(req)
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting) + len(self.preempted),
            num_swapped=len(self.swapped), num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_used_blocks, num_total_blocks=pool.num_blocks,
            kv_usage=pool.usage(), prefix_queries=self.kv.num_prefix_queries,
            prefix_hits=self.kv.num_prefix_hits,
            num_preemptions_recompute=self.num_preemptions["recompute"],
            num_preemptions_swap=self.num_preemptions["swap"],
            swap_out_blocks=self.num_swap_out_blocks, swap_in_blocks=self.num_swap_in_blocks)

    def check_integrity(self) -> None:
        """Invariants tests assert after every step."""
        groups = {RequestStatus.RUNNING: self.running, RequestStatus.WAITING: list(self.waiting),
                  RequestStatus.PREEMPTED: list(self.preempted),
                  RequestStatus.SWAPPED: list(self.swapped)}
        seen: set[str] = set()
        for status, reqs in groups.items():
            for r in reqs:
                if r.status != status:
                    raise AssertionError(f"{r.request_id} is {r.status.name} in the {status.name} list")
                if r.request_id in seen:
                    raise AssertionError(f"{r.request_id} is in two queues")
                seen.add(r.request_id)
        if seen != set(self.requests):
            raise AssertionError("the queues and the request table disagree")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError("more running sequences than max_num_seqs")
        for r in self.running:
            held = len(self.kv.req_blocks.get(r.request_id, ()))
            if held < self.kv.blocks_needed(r.num_computed_tokens):
                raise AssertionError(f"{r.request_id} computed more tokens than its blocks hold")
        for r in self.swapped:
            if r.request_id not in self.kv.swapped_blocks:
                raise AssertionError(f"swapped {r.request_id} has no host blocks")
        if self._padding and not self.running:
            raise AssertionError("static padding rows outlived their batch")
        self.kv.check_integrity(set(self.requests) | {r.request_id for r in self._padding})
