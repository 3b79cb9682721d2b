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

from everystop.config import SchedulerConfig
from everystop.core.arrival_rate import ArrivalRate
from everystop.core.decode_batch import EAGER_DECODES, DecodeBatch
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
from everystop.core.pass_results import apply_pass_results
from everystop.core.preemption import (
    PreemptionCostModel,
    choose_strategy,
    is_protected,
    victim_rank,
)
from everystop.core.request import Request, RequestStatus
from everystop.core.request_queue import RequestQueue
from everystop.core.spec_sizing import SpecSizer
from everystop.core.speculation import DraftCheck, Proposer, make_proposer
from everystop.core.static_batch import schedule_static
from everystop.core.step_budget import StepBudget, TierTargets, default_target_s
from everystop.core.step_cost import StepCostModel, StepShape
from everystop.core.verification import add_proposals

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
        # Whether any request has named a LoRA adapter: stats list the adapters in use only then
        # (a walk of the queues every step is not worth it for a base-only server).
        self.serves_lora = False
        # Lowered after a pass runs out of memory (shrink_after_oom), regrown as passes succeed.
        self.oom_seat_cap = SeatCap()
        # What a forward pass costs here, learnt from every result (update_from_output), and
        # the TPOT target used where none is configured, derived from it once, at start-up.
        self.step_cost = step_cost or StepCostModel.from_prefill_rate(
            self.cost_model.prefill_tokens_per_s)
        self.auto_tpot_target_s = default_target_s(self.step_cost)
        self.last_prefill_budget_tokens = config.max_num_batched_tokens
        self._tier_targets = TierTargets()
        # Who decodes the first rows of `running` (core/decode_batch.py): the scheduler itself,
        # one by one, unless a caller holds them in bulk (the fleet simulator's decode stretch).
        self.decode_batch: DecodeBatch = EAGER_DECODES
        # Speculative decoding (core/verification.py): the proposer, each sequence's k
        # (core/spec_sizing.py), and the proposals verified and accepted so far.
        self.proposer: Proposer | None = self._make_proposer(config)
        # Structured output's grammar check on proposals, set by the engine that owns it.
        self.draft_check: DraftCheck | None = None
        self.spec_sizer = SpecSizer()
        # The recent arrival rate: speculation yields passes that arrivals would wait behind
        # (core/arrival_rate.py).
        self.arrivals = ArrivalRate()
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
        self.serves_lora = self.serves_lora or req.lora_id >= 0
        self.waiting.push(req)
        self._queued.add(req, +1, self.clock())
        self.arrivals.note(req.arrival_time)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish(req, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request for a reason only the engine can see (a stop string)."""
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, status)

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
        if len(self.running) > self.num_seats:  # max_num_seqs lowered at runtime
            self._take_back_decodes(step)
            while len(self.running) > self.num_seats:
                self._preempt(min(self.running, key=lambda r: victim_rank(r, cfg, now)), step)
        if cfg.scheduling == "static":
            schedule_static(self, step)
        else:
            prefilling = self._schedule_decodes(step)
            self._speculate(step, prefilling)
            self._schedule_prefill_chunks(prefilling, step)
            self._admit_swapped(step)
            self._admit(self.preempted, step)
            self._admit(self.waiting, step)
        self.num_swap_out_blocks += len(out.blocks_to_swap_out)
        self.num_swap_in_blocks += len(out.blocks_to_swap_in)
        self.last_prefill_budget_tokens = budget.prefill_budget_tokens
        out.running_lora_ids = frozenset(r.lora_id for r in self.running if r.lora_id >= 0)
        return step.finish()

    def _schedule_decodes(self, step: PassBuilder) -> list[Request]:
        """1. One token for every running sequence past its prompt, first: a skipped decode
        stalls that stream for a whole iteration. Returns the rows still in their prompt."""
        prefilling = []
        held = self.decode_batch.begin_pass(step)  # rows held in bulk, budgeted by their holder
        for req in self.running[held:]:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier row's growth
            if req.num_tokens - req.num_computed_tokens != 1:
                prefilling.append(req)
            elif self.grow(req, 1, step):
                self.emit(step, req, 1)
        return prefilling

    def _speculate(self, step: PassBuilder, prefilling: list[Request]) -> None:
        """1b. Proposals on the decode rows, after all of them and before any prefill, when no
        prompt is in line or likely to arrive (core/spec_room.py). Not in the static
        baseline, nor while a caller holds decode rows in bulk (the simulator)."""
        if (self.proposer is not None and not self.decode_batch.holds_rows and step.decodes
                and self.config.scheduling == "continuous"):
            add_proposals(self, step, model_len_limit(self.config, self.kv), prefilling)

    def _schedule_prefill_chunks(self, prefilling: list[Request], step: PassBuilder) -> None:
        """2. Then the rest of the prompt of sequences already admitted, in admission order,
        as far as the budget goes."""
        for req in prefilling:
            if req.status is not RequestStatus.RUNNING or req.request_id in step.decodes:
                continue
            n = step.prefill_size(self.config, req, req.num_computed_tokens)
            if n and self.grow(req, n, step):
                self.emit(step, req, n)

    def _take_back_decodes(self, step: PassBuilder) -> None:
        """Before a preemption ranks the running rows: those held in bulk become the
        scheduler's own again (up to date, and emitted first if their pass had begun)."""
        batch, self.decode_batch = self.decode_batch, EAGER_DECODES
        batch.give_back(step)

    def leave_running(self, req: Request) -> None:
        self.running.remove(req)
        if not self.running and self._padding:
            self._release_padding()  # the static batch has drained: nobody is left to pad for

    def _release_padding(self) -> None:
        for req in self._padding:
            self.kv.forget(req)
        self._padding.clear()

    def _adapter_waits(self, req: Request) -> bool:
        """Whether running `req` would make the running requests use more LoRA adapters than
        max_loras allows."""
        cap = self.config.max_loras
        if not cap or req.lora_id < 0:
            return False
        active = {r.lora_id for r in self.running if r.lora_id >= 0}
        return req.lora_id not in active and len(active) >= cap

    def _admit_swapped(self, step: PassBuilder) -> None:
        while self.swapped and len(self.running) < self.num_seats:
            req = self.swapped.peek()
            if self._adapter_waits(req):
                return
            n = step.prefill_size(self.config, req, req.num_computed_tokens)
            if not n or not self.kv.can_swap_in(req, n):
                return
            self.swapped.pop()
            step.out.blocks_to_swap_in.extend(self.kv.swap_in(req, n))
            step.out.swapped_in_request_ids.append(req.request_id)
            self._set_running(req, step)
            self.emit(step, req, n)

    def _admit(self, queue: RequestQueue, step: PassBuilder) -> None:
        while queue:
            req = queue.peek()
            if self._adapter_waits(req):
                return  # head-of-line, as for memory: the aging order decides who goes next
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
            self.start_running(req, computed, step)
            self.emit(step, req, n)

    def start_running(self, req: Request, computed: list, step: PassBuilder) -> None:
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

    def emit(self, step: PassBuilder, req: Request, n: int) -> None:
        step.emit(req, n, self.kv.block_ids(req.request_id))

    # -- preemption -----------------------------------------------------------------------------
    def grow(self, req: Request, n: int, step: PassBuilder) -> bool:
        """Make room for n more tokens of a running request, preempting lower-ranked sequences
        if the pool is short. If nothing ranks below it, the request itself is preempted
        (False). NOTE: the ranking is a total order, so the top-ranked sequence always makes
        progress - the engine cannot deadlock on KV memory."""
        if self.kv.allocate(req, n):
            return True
        self._take_back_decodes(step)  # a victim may be among them
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
        self._take_back_decodes(step)  # a victim may be among them
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
        self.leave_running(victim)
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
            self.recompute_later(victim)
        victim.preemption_count += 1
        victim.preemption_times.append(now)
        self.num_preemptions[strategy] += 1
        out.preempted_request_ids.append(victim.request_id)

    def recompute_later(self, victim: Request) -> None:
        """Free the victim's blocks (host copy too) and queue it to run again from token 0."""
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions_recompute += 1
        self.preempted.push(victim)

    # -- what its helper modules read (core/scheduler_state.py) ----------------------------------
    @property
    def queued_counts(self) -> QueuedCounts:
        return self._queued

    @property
    def padding_rows(self) -> list[Request]:
        return self._padding

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
        """Apply what the executor ran and sampled (core/pass_results.py): an update per
        request that got tokens or finished."""
        # Learn what this pass cost (an executor that does not time itself reports 0).
        self.step_cost.observe(StepShape.from_output(sched), result.execute_time_s)
        self.oom_seat_cap.pass_succeeded(self.config.max_num_seqs)
        return apply_pass_results(self, sched, result)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Free the request's blocks and slot now, whatever state it was in (a static batch
        member with padding on keeps its blocks as a padding row until the batch drains)."""
        keep_as_padding = False
        if req.status == RequestStatus.RUNNING:
            self.leave_running(req)
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
        self.spec_sizer.forget(req.request_id)
        self._finished_ids.append(req.request_id)

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return scheduler_stats(self)

    def check_integrity(self) -> None:
        """Invariants tests assert after every step (core/inspection.py)."""
        check_scheduler_integrity(self)
