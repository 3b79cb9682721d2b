"""The iteration-level scheduler: decides, for every forward pass, which tokens run.

Each `schedule()` builds one pass (a `PassBuilder`, made fresh per call) under one budget:

  1. one decode token for every running sequence that has finished its prompt - first and
     unconditionally (if the pool is short, a lower-ranked sequence is preempted, never skipped);
  2. prefill chunks for running sequences still working through their prompt;
  3. resumed sequences (swapped in from host, then recompute-preempted), ahead of
  4. new admissions, in priority-with-aging then arrival order, while sequence count, budget and
     KV blocks above the watermark allow (room for the whole prompt, while others run).

The budget (core/step_budget.py) is max_num_batched_tokens, a hard cap, and a step-time target:
prefill gets only the tokens that keep the predicted step time (core/step_cost.py, fitted to
every measured pass) within the tightest TPOT target of the tiers decoding in this pass. Never
starving either side: decodes are never limited by time, and a prompt that has waited longer
than aging_interval_s gets a floor chunk per step (the tokens an empty step runs within the
target, at least one KV block) even if the step then overshoots its target.

There is no prefill phase and decode phase: each request has `num_computed_tokens` and the
scheduler hands out tokens so that it catches up. `update_from_output()` applies what the
executor sampled, finishes requests (freeing their blocks at once) and reports per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from everystop.config import SchedulerConfig
from everystop.core.failed_pass import recompute_swapped
from everystop.core.inspection import check_scheduler_integrity, scheduler_stats
from everystop.core.intake import (
    QueuedCounts,
    QueueFull,
    RequestRejected,
    check_admissible,
    model_len_limit,
)
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.oom_backoff import SeatCap, shrink_after_oom
from everystop.core.outputs import (
    ModelOutput,
    RequestUpdate,
    SchedulerOutput,
    SchedulerStats,
)
from everystop.core.pass_builder import PassBuilder
from everystop.core.preemption import (
    PreemptionCostModel,
    choose_strategy,
    is_protected,
    victim_rank,
)
from everystop.core.request import Request, RequestStatus
from everystop.core.request_queue import RequestQueue
from everystop.core.speculation import Proposer, make_proposer
from everystop.core.static_batch import schedule_static
from everystop.core.step_budget import StepBudget, TierTargets, default_target_s
from everystop.core.step_cost import StepCostModel, StepShape
from everystop.core.verification import add_proposals, apply_verified


class LazyDecodes(Protocol):
    """Decode rows held in bulk by the caller: the first rows of `running`, in its order, each
    decoding one token per pass, their tokens brought up to date only when given back."""

    def begin_pass(self, step: PassBuilder) -> int:
        """At the pass's start: grow the rows' blocks and add them to the budget, in running
        order, as step 1 would; how many leading rows of `running` that covers (0: it gave
        them back instead, e.g. the pool is short for their growth)."""
        ...

    def give_back(self, step: PassBuilder) -> None:
        """Bring the rows up to date; if this pass had begun, emit them first in `step`'s
        decodes (budget already counted). The scheduler then treats them as any row."""
        ...


__all__ = ["QueueFull", "RequestRejected", "Scheduler", "SchedulerStats"]  # re-exported


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, *,
                 cost_model: PreemptionCostModel | None = None,
                 step_cost: StepCostModel | None = None,
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
        self._queued = QueuedCounts()  # first admissions pending, for the queue caps
        self._finished_ids: list[str] = []
        # Static padding: finished members of the running static batch, holding their blocks.
        self._padding: list[Request] = []
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_swap_out_blocks = 0
        self.num_swap_in_blocks = 0
        self.num_steps = 0
        # Lowered after a pass runs out of memory (shrink_after_oom), regrown as passes succeed.
        self.oom_seat_cap = SeatCap()
        # What a forward pass costs here, learnt from every result (update_from_output), and
        # the TPOT target used where none is configured, derived from it once, at start-up.
        self.step_cost = step_cost or StepCostModel.from_prefill_rate(
            self.cost_model.prefill_tokens_per_s)
        self.auto_tpot_target_s = default_target_s(self.step_cost)
        self.last_prefill_budget_tokens = config.max_num_batched_tokens
        self._tier_targets = TierTargets()
        # Decode rows a caller keeps in bulk: the fleet simulator's decode stretch holds the
        # first rows of `running` through passes the scheduler runs (LazyDecodes). None in the
        # engine.
        self.lazy: LazyDecodes | None = None
        # Speculative decoding (core/verification.py): the proposer, and the proposals
        # verified and accepted so far.
        self.proposer: Proposer | None = self._make_proposer(config)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens

    @staticmethod
    def _make_proposer(config: SchedulerConfig) -> Proposer | None:
        return make_proposer(config.speculative, config.ngram_min, config.ngram_max)

    # -- intake ---------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request, or raise RequestRejected / QueueFull right away."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        check_admissible(req, self.config, self.kv, self._queued, self.clock())
        if req.arrival_time == 0.0:
            req.arrival_time = self.clock()
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.push(req)
        self._queued.add(req, +1, self.clock())

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
        old, self.config = self.config, config
        # A draft model stays attached while the method is unchanged (it cannot be loaded
        # here); the n-gram proposer is rebuilt, its sizes may have changed.
        if config.speculative != old.speculative or not config.speculative.startswith("draft:"):
            self.proposer = self._make_proposer(config)
        per_pos = self.num_accepted_tokens_per_pos  # counters only grow: they are exported
        per_pos.extend([0] * (config.num_speculative_tokens - len(per_pos)))
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
        cfg = self.config
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        timed = cfg.scheduling == "continuous"  # the static baseline runs whole batches, untimed
        budget = StepBudget(cfg.max_num_batched_tokens,
                            self.step_cost.coefficients if timed else None,
                            self._tier_targets.get(cfg, self.auto_tpot_target_s),
                            self.kv.block_size)
        step = PassBuilder(now, budget, out)

        if self._padding and cfg.scheduling != "static":  # switched at run time
            self._release_padding()
        if self.lazy is not None and len(self.running) > self.num_seats:
            self._give_back_lazy(step)
        while len(self.running) > self.num_seats:  # max_num_seqs lowered at runtime
            self._preempt(min(self.running, key=lambda r: victim_rank(r, cfg, now)), step)
        if cfg.scheduling == "static":
            schedule_static(self, step)
        else:
            self._schedule_running(step)
            self._admit_swapped(step)
            self._admit(self.preempted, step)
            self._admit(self.waiting, step)
        self.num_swap_out_blocks += len(out.blocks_to_swap_out)
        self.num_swap_in_blocks += len(out.blocks_to_swap_in)
        self.last_prefill_budget_tokens = budget.prefill_budget_tokens
        return step.finish()

    def _schedule_running(self, step: PassBuilder) -> None:
        # 1. Decodes first: a skipped decode stalls that stream for a whole iteration.
        # NOTE: this loop runs once per running sequence per pass (the simulator's hot path):
        # the checks are inlined, the status is re-read each time (a _grow may preempt a
        # later sequence), and the common grow - room in the blocks held - skips _grow.
        running = RequestStatus.RUNNING
        kv, emit = self.kv, step.emit
        held, bs, ids = kv.req_blocks, kv.block_size, kv.block_ids
        # Those not decoding, for step 2: the rows running after step 1 that are not decodes
        # (step 1 only removes from `running`, and emits or preempts every decode it visits).
        prefilling = []
        # The lazy rows (the first of `running`) grow and are budgeted in bulk, in this order.
        skip = self.lazy.begin_pass(step) if self.lazy is not None else 0
        for req in self.running[skip:]:
            if req.status is not running:
                continue
            computed = req.num_computed_tokens
            if len(req.prompt_token_ids) + len(req.output_token_ids) - computed != 1:
                prefilling.append(req)
                continue
            blocks = held.get(req.request_id)
            if (blocks is not None and computed < len(blocks) * bs) or self._grow(req, 1, step):
                emit(req, 1, ids(req.request_id))
        self._speculate(step)
        # 2. Then the rest of the prompt of sequences already admitted, in admission order.
        decodes = step.decodes
        for req in prefilling:
            if req.status is not running or req.request_id in decodes:
                continue
            n = step.prefill_size(self.config, req, req.num_computed_tokens)
            if n and self._grow(req, n, step):
                self._emit(step, req, n)

    def _speculate(self, step: PassBuilder) -> None:
        """1b. Proposals on the decode rows, after all of them and before any prefill. Not in
        the static baseline, nor while a caller holds decode rows in bulk (the simulator)."""
        if (self.proposer is not None and self.lazy is None and step.decodes
                and self.config.scheduling == "continuous"):
            add_proposals(self, step, model_len_limit(self.config, self.kv))

    def _give_back_lazy(self, step: PassBuilder) -> None:
        """The lazy rows become ordinary rows of this pass (up to date, and emitted first if
        their pass had begun): a preemption is about to rank them."""
        lazy, self.lazy = self.lazy, None
        assert lazy is not None
        lazy.give_back(step)

    def _leave_running(self, req: Request) -> None:
        self.running.remove(req)
        if not self.running and self._padding:
            self._release_padding()  # the static batch has drained: nobody is left to pad for

    def _release_padding(self) -> None:
        for req in self._padding:
            self.kv.forget(req)
        self._padding.clear()

    def _admit_swapped(self, step: PassBuilder) -> None:
        while self.swapped and len(self.running) < self.num_seats:
            req = self.swapped.peek()
            n = step.prefill_size(self.config, req, req.num_computed_tokens)
            if not n or not self.kv.can_swap_in(req, n):
                return
            self.swapped.pop()
            step.out.blocks_to_swap_in.extend(self.kv.swap_in(req, n))
            step.out.swapped_in_request_ids.append(req.request_id)
            self._set_running(req, step)
            self._emit(step, req, n)

    def _admit(self, queue: RequestQueue, step: PassBuilder) -> None:
        while queue:
            req = queue.peek()
            if len(self.running) >= self.num_seats and not self._preempt_worse_tier(
                    req, step):
                return
            computed = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
            start = len(computed) * self.kv.block_size
            n = step.prefill_size(self.config, req, start)
            if not n:
                return
            # Start a prompt only if all of it fits while others run: else the decodes' growth
            # preempts it mid-prompt, again and again (a starved pool thrashed under step budgets).
            while self.running and not self.kv.can_allocate(
                    req, req.num_tokens - start, computed, reserve_watermark=True,
                    max_pass_tokens=self.config.max_num_batched_tokens):
                if not self._preempt_worse_tier(req, step):
                    return
            while not self.kv.allocate(req, n, computed, reserve_watermark=True):
                if not self._preempt_worse_tier(req, step):
                    return  # head-of-line waits: lower tiers may not jump ahead of it
            queue.remove(req)  # NOTE: not pop(): a victim preempted above may now head it
            self._start_running(req, computed, step)
            self._emit(step, req, n)

    def _start_running(self, req: Request, computed: list, step: PassBuilder) -> None:
        if req.status == RequestStatus.WAITING:
            self._queued.add(req, -1, step.now)
        if req.num_computed_tokens == 0:  # the admissions that looked the prefix up
            self.kv.count_prefix_use(req, len(computed))
        req.num_computed_tokens = len(computed) * self.kv.block_size
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        if req.admitted_time is None:
            req.admitted_time = step.now
        self._set_running(req, step)

    def _set_running(self, req: Request, step: PassBuilder) -> None:
        req.status = RequestStatus.RUNNING
        req.last_admitted_time = step.now
        self.running.append(req)
        step.admitted_now.add(req.request_id)

    def _emit(self, step: PassBuilder, req: Request, n: int) -> None:
        step.emit(req, n, self.kv.block_ids(req.request_id))

    # -- preemption -----------------------------------------------------------------------------
    def _grow(self, req: Request, n: int, step: PassBuilder) -> bool:
        """Make room for n more tokens of a running request, preempting lower-ranked sequences
        if the pool is short. If nothing ranks below it, the request itself is preempted
        (False). NOTE: the ranking is a total order, so the top-ranked sequence always makes
        progress - the engine cannot deadlock on KV memory."""
        if self.kv.allocate(req, n):
            return True
        if self.lazy is not None:  # a victim may be among them
            self._give_back_lazy(step)
        cfg, now = self.config, step.now
        rank = victim_rank(req, cfg, now)
        while not self.kv.allocate(req, n):
            victims = [r for r in self.running if r is not req
                       and r.request_id not in step.admitted_now
                       and victim_rank(r, cfg, now) < rank]
            if not victims:
                self._preempt(req, step)
                return False
            self._preempt(min(victims, key=lambda r: victim_rank(r, cfg, now)), step)
        return True

    def _preempt_worse_tier(self, req: Request, step: PassBuilder) -> bool:
        """Free a seat or blocks for a waiting request by preempting a running one of a strictly
        lower tier (never a protected one, never one admitted this step)."""
        if self.lazy is not None:  # a victim may be among them
            self._give_back_lazy(step)
        cfg, now = self.config, step.now
        victims = [r for r in self.running if r.priority > req.priority
                   and r.request_id not in step.admitted_now
                   and not is_protected(r, cfg, now)]
        if not victims:
            return False
        self._preempt(min(victims, key=lambda r: victim_rank(r, cfg, now)), step)
        return True

    def _preempt(self, victim: Request, step: PassBuilder) -> None:
        now, out = step.now, step.out
        entry = step.decodes.get(victim.request_id)
        if entry is not None and entry.num_draft_tokens:  # the proposals' blocks go first
            self.kv.trim(victim, victim.num_computed_tokens + 1)
        step.drop(victim.request_id)
        self._leave_running(victim)
        num_blocks = self.kv.num_held_blocks(victim.request_id)
        can_swap = (self.kv.can_swap_out(victim)
                    and len(self.swapped) < self.config.max_swapped_seqs)
        strategy = choose_strategy(victim, num_blocks, self.config, self.cost_model, can_swap, now)
        if strategy == "swap":
            out.blocks_to_swap_out.extend(self.kv.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            victim.num_preemptions_swap += 1
            self.swapped.push(victim)
        else:
            self._recompute_later(victim)
        victim.preemption_count += 1
        victim.preemption_times.append(now)
        self.num_preemptions[strategy] += 1
        out.preempted_request_ids.append(victim.request_id)

    def _recompute_later(self, victim: Request) -> None:
        """Free the victim's blocks (host copy too) and queue it to run again from token 0."""
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions_recompute += 1
        self.preempted.push(victim)

    # -- the steps its helper modules share (core/scheduler_state.py) ----------------------------
    @property
    def queued_counts(self) -> QueuedCounts:
        return self._queued

    @property
    def padding_rows(self) -> list[Request]:
        return self._padding

    def grow(self, req: Request, n: int, step: PassBuilder) -> bool:
        return self._grow(req, n, step)

    def emit(self, step: PassBuilder, req: Request, n: int) -> None:
        self._emit(step, req, n)

    def start_running(self, req: Request, computed: list, step: PassBuilder) -> None:
        self._start_running(req, computed, step)

    def leave_running(self, req: Request) -> None:
        self._leave_running(req)

    def recompute_later(self, victim: Request) -> None:
        self._recompute_later(victim)

    def finish(self, req: Request, status: RequestStatus) -> None:
        self._finish(req, status)

    @property
    def padding_lag(self) -> int:
        """How far before its computed tokens a running row's next query may lie: one for a
        static batch's member, which may end as a padding row recomputing its last position."""
        return int(self.config.scheduling == "static" and self.config.static_padding)

    @property
    def num_seats(self) -> int:
        """Sequences a pass may hold now: max_num_seqs, or less after an out-of-memory pass."""
        return self.oom_seat_cap.seats(self.config.max_num_seqs)

    def shrink_after_oom(self, failed: SchedulerOutput) -> SchedulerOutput | None:
        """The pass to run again after `failed` ran out of memory (oom_backoff.py), or None."""
        return shrink_after_oom(self, failed)

    def recompute_swapped(self, failed: SchedulerOutput) -> SchedulerOutput:
        """After `failed` raised: recompute what it swapped; the pass that may run again
        (core/failed_pass.py)."""
        return recompute_swapped(self, failed)

    # -- results --------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput,
                           result: ModelOutput) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        now = self.clock()
        # Learn what this pass cost (an executor that does not time itself reports 0).
        self.step_cost.observe(StepShape.from_output(sched), result.execute_time_s)
        self.oom_seat_cap.pass_succeeded(self.config.max_num_seqs)
        # Loop invariants hoisted: this loop runs once per scheduled row (the hot path).
        # The prefix-cache registration (cache_computed_blocks) is called only for rows that
        # filled a block since their last registration: its own first check, inlined.
        requests, running = self.requests, RequestStatus.RUNNING
        kv = self.kv
        cache_blocks, caching = kv.cache_computed_blocks, kv.enable_prefix_caching
        # Under a sliding window, each row releases what its next query cannot read (after
        # registering it: released blocks stay in the prefix cache).
        release = kv.release_behind_window if kv.window is not None else None
        lag = self.padding_lag
        registered, bs = kv.registered_blocks, kv.block_size
        prompt_logprobs, logprobs = result.prompt_logprobs, result.logprobs
        sampled = result.sampled_token_ids
        max_len = model_len_limit(self.config, kv)
        for entry in sched.scheduled:
            rid = entry.request_id
            req = requests.get(rid)
            if req is None or req.status is not running:
                continue  # aborted while the pass ran
            if entry.num_draft_tokens:
                update = apply_verified(self, entry, req, result.verified_token_ids.get(rid),
                                        max_len, result.verified_logprobs.get(rid))
                if update is not None:
                    updates.append(update)
                continue
            computed = req.num_computed_tokens = entry.start_pos + len(entry.token_ids)
            if caching and computed // bs > registered.get(rid, 0):
                cache_blocks(req)
            if release is not None:
                release(req, computed - lag)
            if prompt_logprobs:
                scored = prompt_logprobs.get(rid)
                if scored:
                    req.keep_prompt_logprobs(entry.start_pos, scored)
            if not entry.sample:
                continue
            token = sampled[rid]
            output = req.output_token_ids
            output.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            update = RequestUpdate(rid, [token])
            params = req.sampling_params
            if params.prompt_logprobs is not None and len(output) == 1:
                update.prompt_logprobs = list(req.prompt_logprobs)
            if logprobs:
                lp = logprobs.get(rid)
                if lp is not None:
                    update.new_logprobs.append(lp)
            # How the request ends with `token` just appended: EOS (unless ignored) or a stop
            # token id, then max_tokens or the model length; most rows go on.
            num_output = len(output)
            if (not params.ignore_eos and token == req.eos_token_id) or (
                    token in params.stop_token_ids):
                update.stop_token_id = token
                status = RequestStatus.FINISHED_STOPPED
            elif (num_output >= params.max_tokens
                  or len(req.prompt_token_ids) + num_output >= max_len):
                status = RequestStatus.FINISHED_LENGTH
            else:
                updates.append(update)
                continue
            self._finish(req, status)
            update.finish_reason = status.finish_reason
            updates.append(update)
        return updates

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
            self._queued.add(req, -1, self.clock())
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
        return scheduler_stats(self)

    def check_integrity(self) -> None:
        """Invariants tests assert after every step (core/inspection.py)."""
        check_scheduler_integrity(self)
