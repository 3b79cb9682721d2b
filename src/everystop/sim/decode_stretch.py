"""Pure-decode stretches: a simulated replica's passes applied many at a time, with exactly the
result of running them one by one through its `Scheduler`.

When every running sequence of a replica is decoding and nothing waits for it (no queue, no
inbox, nothing swapped), its next passes are decided already: one token per sequence, each pass
timed by the cost model from (rows, summed context), until an arrival is routed to it, a
sequence finishes, or the pool runs out of blocks for the rows' growth. The fleet loop then
plans the pass times ahead (`plan`) without touching the scheduler, and applies the passes'
effects lazily (`advance`), in the order the scheduler would:

    pass j ends (update j)   the step-cost fit observes it (where it steers the budget), then in
                             running order: a row whose block just filled registers it in the
                             prefix cache, a row at its last token finishes (Scheduler.finish_
                             request: blocks freed, the request gone)
    pass j+1 starts          in running order: a row at a block boundary gets its next block
                             through the real KVCacheManager.allocate

Tokens and positions of a row are brought up to date only when one of those touches it (and at
the stretch's end), so a pass costs the cost model's arithmetic plus the rows that cross a block
boundary in it. The fleet loop makes every change visible when the real loop would: a finish is
an event at its pass end (router.on_finished), a load report first applies the passes that ended
before it, and an arrival routed here ends the planned passes with the pass it arrived in; the
next passes are then the scheduler's. A pass that would run the pool dry (the scheduler would
preempt) also ends the planned passes before it starts.

Mixed passes: the rows stay the stretch's while the scheduler runs the passes that admit and
prefill the newcomer (`to_mixed`). They are the first rows of `Scheduler.running`, held in bulk
as its `decode_batch` (core/decode_batch.py): at each such pass's start the scheduler has the
stretch grow their blocks and add them to the pass's budget, in running order, as its own decode
loop would (`begin_pass`), and walks only the other rows; the pass's shape counts them
(`SchedulerOutput.num_bulk_decodes`);
at its end the stretch applies their registrations and finishes before `update_from_output`
does the other rows' (`end_mixed`: their order in the pass). Once every running row decodes and
nothing waits, the newcomers join the stretch at that boundary (`absorb`) and planned passes
resume. Where the scheduler would rank the rows for a preemption (a pool short for growth, a
seat or blocks for a better tier), it first takes them back, brought up to date and emitted
as its own rows of that pass (`give_back`), and the stretch is over. A newcomer thus costs the
rows it adds, not a walk over every row of the replica per pass.

NOTE: the step-cost fit (`Scheduler.step_cost`) is replayed pass by pass only when a TPOT target
is on, the one case where it steers a decision (the prefill budget); with every target off it
decides nothing, and its coefficients (reported in `Scheduler.stats()`) then reflect only the
passes the scheduler ran itself (as does `Scheduler.last_prefill_budget_tokens`).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Callable

from everystop.core.decode_batch import EAGER_DECODES, add_held_rows, emit_given_back
from everystop.core.intake import model_len_limit
from everystop.core.pass_builder import PassBuilder
from everystop.core.request import Request, RequestStatus
from everystop.core.scheduler import Scheduler
from everystop.core.step_budget import tier_targets_s
from everystop.core.step_cost import StepShape
from everystop.sim.cost_model import CostModel, IterationShape
from everystop.sim.sim_executor import SimClock, SimExecutor

TOKEN = SimExecutor.SAMPLED_TOKEN
# How many passes a plan looks ahead at first (then doubling): an arrival usually ends a stretch
# within a few passes, and the pass times planned past it are thrown away.
FIRST_PLAN_PASSES = 8


def can_stretch(sched: Scheduler, num_inbox: int, skip: int = 0) -> bool:
    """Whether the replica's next pass is pure decode with nothing that could join it (the
    first `skip` running rows are a stretch's already). Never under a sliding window: a
    stretch's rows do not release the blocks their window passes."""
    if (num_inbox or not sched.running or sched.waiting or sched.preempted or sched.swapped
            or sched.config.scheduling != "continuous" or sched.oom_seat_cap.limit is not None
            or len(sched.running) > sched.num_seats or sched.kv.window is not None):
        return False
    running = RequestStatus.RUNNING
    # Newest first: a prompt still mid-prefill (the usual reason to say no once the queues are
    # empty) was admitted last, so the scan stops at once rather than after every decode row.
    for req in reversed(sched.running[skip:]):
        params = req.sampling_params
        if (req.status is not running or not req.output_token_ids
                or len(req.prompt_token_ids) + len(req.output_token_ids)
                - req.num_computed_tokens != 1
                or TOKEN in params.stop_token_ids
                or (not params.ignore_eos and req.eos_token_id == TOKEN)):
            return False
    return True


class DecodeStretch:
    """The passes of one replica from its clock's now on, while it stays pure decode.

    Boundary j is the end of pass j (pass 1 starts now, at boundary 0). Rows are the running
    sequences, indexed in running order (their order in every pass). `account(latency)` is
    called once per pass, in order, as its end is applied. In mixed passes it is the
    scheduler's `DecodeBatch`."""

    holds_rows = True

    def __init__(self, sched: Scheduler, clock: SimClock,
                 latency_fn: Callable[[IterationShape], float],
                 account: Callable[[float], None]) -> None:
        self.sched, self.kv, self.clock = sched, sched.kv, clock
        self.latency_fn, self.account = latency_fn, account
        # The cost model's own latency has a pure-decode form that builds no shape per planned
        # pass (CostModel.decode_latency: the same float); any other latency_fn is called as is.
        owner = getattr(latency_fn, "__self__", None)
        self.decode_latency: Callable[[int, int], float] | None = (
            owner.decode_latency if isinstance(owner, CostModel)
            and getattr(latency_fn, "__func__", None) is CostModel.latency else None)
        cfg = sched.config
        self.replay_fit = any(t is not None
                              for t in tier_targets_s(cfg, sched.auto_tpot_target_s))
        self.bs = bs = self.kv.block_size
        self.caching = self.kv.enable_prefix_caching
        max_len = model_len_limit(cfg, self.kv)
        self.rows: list[Request] = list(sched.running)
        n = len(self.rows)
        self.base: list[int] = []  # computed at boundary 0
        self.at = [0] * n  # the boundary each row's tokens are brought up to
        # The pass whose sampled token ends the row (Scheduler.update_from_output's stop check:
        # max_tokens or the model length; the sampled token is never a stop token here, see
        # can_stretch).
        self.finish_at: list[int] = []
        self.alive = n
        # The plan: times[j] = end of pass j (times[0] = now), with its latency, rows, context.
        self.times = [clock.now]
        self.lat = [0.0]
        self.pass_rows = [0]
        self.pass_context = [0]
        self.planned = 0
        self.look_ahead = FIRST_PLAN_PASSES
        self.end: int | None = None  # the boundary the stretch ends at, once known
        self.applied = 0  # pass ends applied
        self.started = -1  # pass starts applied (as boundaries: pass j+1 starts at j)
        # Effects to apply, by boundary: rows whose update does something (a block filled, the
        # last token) and rows that grow by a block at the next pass's start.
        self.on_end: dict[int, list[int]] = {}
        self.on_start: dict[int, list[int]] = {}
        # Growth as planned against the pool: per boundary, how many rows grow there (one
        # pending entry per live row, at or past `grow_frontier`), and growth counted but not
        # yet applied.
        self.first_grow: list[int] = []
        self.grow_count: dict[int, int] = {}
        self.grow_frontier = 1
        self.unapplied_grows = 0
        self.plan_grows: dict[int, int] = {}  # pass -> growth plan() counted at its start
        # NOTE: one loop per stretch over every row (a stretch starts after each mixed pass),
        # so it binds what it uses once. Each row is filed under the next pass end that touches
        # it (on_end): the one that fills its block (prefix caching on) or its last token's.
        held = self.kv.req_blocks
        first_grow, grow_count, on_start = self.first_grow, self.grow_count, self.on_start
        on_end, caching = self.on_end, self.caching
        bases, finish_at = self.base, self.finish_at
        for i, req in enumerate(self.rows):
            num_output = len(req.output_token_ids)
            base = req.num_computed_tokens
            finish = max(1, min(req.sampling_params.max_tokens - num_output,
                                max_len - len(req.prompt_token_ids) - num_output))
            bases.append(base)
            finish_at.append(finish)
            g = len(held.get(req.request_id, ())) * bs - base  # pass g+1 needs a block
            first_grow.append(g)
            if g < finish:
                on_start.setdefault(g, []).append(i)
                if g == 0:  # grows as pass 1 starts, next at boundary bs (voided if it ends)
                    self.unapplied_grows += 1
                    grow_count[bs] = grow_count.get(bs, 0) + 1
                else:
                    grow_count[g] = grow_count.get(g, 0) + 1
            nxt = min(finish, 1 + (-(base + 1)) % bs) if caching else finish
            on_end.setdefault(nxt, []).append(i)
        self.finishes = [(f, i) for i, f in enumerate(finish_at)]
        heapq.heapify(self.finishes)
        self.context = sum(bases)  # summed computed tokens of the live rows at `planned`
        self.order = list(range(n))  # the live rows, in running order
        # In step with `order`: each live row's base, and how many live rows each tier has
        # (what a mixed pass's budget takes from them, without a walk over the rows' requests).
        self.order_base = list(bases)
        self.tiers: dict[int, int] = {}
        for req in self.rows:
            self.tiers[req.priority] = self.tiers.get(req.priority, 0) + 1
        # Mixed passes (the scheduler's, with these rows held in bulk in them): on
        # between an arrival and the moment every row decodes again (absorb); `begun`: this
        # pass's rows are budgeted; `dead`: given back to the scheduler, the stretch is over.
        self.mixed = self.begun = self.dead = False
        # The first pass's own growth must fit, or the scheduler would preempt in it.
        self.ok = self.unapplied_grows <= self.kv.pool.num_free_blocks

    # -- planning (the scheduler is not touched) -------------------------------------------------
    def plan(self) -> int:
        """Plan passes up to the next finish, the pool running dry, or the look-ahead; returns
        the boundary of the next event the fleet loop must see (at times[boundary])."""
        if self.end is not None:
            return self.end
        stop = min(self.finishes[0][0], self.planned + self.look_ahead)
        self.look_ahead = min(2 * self.look_ahead, 1024)
        free = self.kv.pool.num_free_blocks - self.unapplied_grows
        n, bs, latency_fn, decode_latency = (self.alive, self.bs, self.latency_fn,
                                             self.decode_latency)
        t, ctx = self.times[-1], self.context
        for j in range(self.planned + 1, stop + 1):
            if j >= 2:  # growth at the start of pass j (boundary j-1); boundary 0's is counted
                g = self.grow_count.pop(j - 1, 0)
                if g > free:  # the scheduler would preempt at the start of pass j
                    self.grow_count[j - 1] = g
                    self.end = j - 1
                    break
                if g:
                    free -= g
                    self.unapplied_grows += g
                    self.grow_count[j - 1 + bs] = self.grow_count.get(j - 1 + bs, 0) + g
                    self.plan_grows[j] = g
                self.grow_frontier = j
            ctx += n
            dt = (decode_latency(n, ctx) if decode_latency is not None
                  else latency_fn(IterationShape(n, n, 0, ctx, ctx, n)))
            t += dt
            self.times.append(t)
            self.lat.append(dt)
            self.pass_rows.append(n)
            self.pass_context.append(ctx)
            self.planned = j
            self.context = ctx
        return self.planned if self.end is None else self.end

    def cut_at(self, arrival_s: float) -> int:
        """An arrival routed here at `arrival_s`: the stretch ends with the pass it arrives in
        (the first ending at or after it: at equal times arrivals go first)."""
        if self.applied and arrival_s <= self.times[self.applied]:
            # That pass's end is applied already, its continuation not (a pipelined fleet
            # group applies pass ends ahead of the arrivals they cannot depend on).
            j = self.applied
        else:
            j = bisect_left(self.times, arrival_s, self.applied + 1, self.planned + 1)
        assert j <= self.planned, "an arrival past the stretch's pending event"
        self.end = j if self.end is None else min(self.end, j)
        return self.end

    def boundaries_before(self, t: float) -> int:
        """The last planned boundary that ends strictly before `t`."""
        return bisect_left(self.times, t, self.applied, self.planned + 1) - 1

    # -- applying --------------------------------------------------------------------------------
    def advance(self, boundary: int, *, start_next: bool) -> list[Request]:
        """Apply every pass end up to `boundary` (and the next pass's start if `start_next`);
        the requests that finished, in the order the scheduler finishes them."""
        finished: list[Request] = []
        sched = self.sched
        for j in range(self.applied + 1, boundary + 1):
            if self.started < j - 1:
                self._start(j - 1)
            self.applied = j
            dt = self.lat[j]
            self.account(dt)
            if self.replay_fit:
                sched.step_cost.observe(StepShape(0, self.pass_rows[j], self.pass_context[j]), dt)
            if j in self.on_end:
                self._apply_end(j, finished)
        if start_next and self.started < boundary:
            self._start(boundary)
        return finished

    def _apply_end(self, j: int, finished: list[Request]) -> None:
        """Pass j's end for the rows it touches: a filled block registered, a last token's row
        finished (appended to `finished`)."""
        rows = self.on_end.pop(j)
        self.clock.now = self.times[j]
        # NOTE: once per row per block it fills, so inline: the row's tokens are brought up
        # to j (`at`), then it is filed under its next pass end that touches it.
        sched, kv, bs = self.sched, self.kv, self.bs
        caching, base, finish_at, at, all_rows = (self.caching, self.base, self.finish_at,
                                                  self.at, self.rows)
        on_end = self.on_end
        if len(rows) > 1:
            rows.sort()
        filled = []
        for i in rows:
            req = all_rows[i]
            k = j - at[i]
            if k:
                req.num_computed_tokens += k
                req.output_token_ids.extend([TOKEN] * k)
                at[i] = j
            if caching and (base[i] + j) % bs == 0:
                filled.append(req)
        # Registrations first, then finishes: a finish frees blocks but evicts nothing, so this
        # is the scheduler's row-by-row order in effect.
        if filled:
            kv.cache_next_blocks(filled)
        for i in rows:
            if j == finish_at[i]:
                req = all_rows[i]
                sched.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
                finished.append(req)
                self._drop(i, j)
            else:
                nxt = finish_at[i]
                if caching:
                    nxt = min(nxt, j + 1 + (-(base[i] + j + 1)) % bs)
                on_end.setdefault(nxt, []).append(i)

    def close(self, boundary: int) -> None:
        """The stretch ends at `boundary` (its pass end applied): rows brought up to it."""
        assert self.applied == boundary and self.started < boundary
        self._bring_up(boundary)
        self.clock.now = self.times[boundary]

    def _bring_up(self, boundary: int) -> None:
        rows, at, tokens = self.rows, self.at, TOKEN
        for i in self.order:
            k = boundary - at[i]
            if k:
                req = rows[i]
                req.num_computed_tokens += k
                req.output_token_ids.extend([tokens] * k)
                at[i] = boundary

    # -- mixed passes: the scheduler runs them, these rows ride along (its decode_batch) -------
    def to_mixed(self) -> None:
        """At the stretch's end boundary (applied, the next pass not started): the next passes
        are the scheduler's, with these rows held in bulk. The plan past it is dropped."""
        b = self.applied
        assert self.started < b and self.alive
        # The plan past b undone: its passes' growth counts moved back, as they were when b
        # was the last pass planned (pending entries at or past b, none counted ahead).
        grow_count, bs = self.grow_count, self.bs
        for j in range(self.planned, b, -1):
            g = self.plan_grows.get(j)
            if g:
                left = grow_count[j - 1 + bs] - g
                if left:
                    grow_count[j - 1 + bs] = left
                else:
                    del grow_count[j - 1 + bs]
                grow_count[j - 1] = grow_count.get(j - 1, 0) + g
                self.unapplied_grows -= g
        self.plan_grows.clear()
        assert self.unapplied_grows == 0
        self.grow_frontier = b
        extra = self.planned - b
        if extra:
            self.context -= self.alive * extra
            for planned in (self.times, self.lat, self.pass_rows, self.pass_context):
                del planned[b + 1:]
            self.planned = b
        self.end = None
        self.mixed = True
        self.sched.decode_batch = self
        self.clock.now = self.times[b]

    def begin_pass(self, step: PassBuilder) -> int:
        """DecodeBatch's hook at a mixed pass's start (boundary b = applied): the rows at a
        block boundary grow, then every row is budgeted, in running order, as step 1 would."""
        b = self.applied
        assert self.mixed and not self.begun and self.started == b - 1
        growing = self.on_start.get(b)
        if growing and len(growing) > self.kv.pool.num_free_blocks:
            # The scheduler would preempt for this growth: it gets the rows back to do so.
            self.sched.decode_batch = EAGER_DECODES
            self.give_back(step)
            return 0
        g = self.grow_count.pop(b, 0)
        assert g == len(growing or ())
        if g:
            self.grow_count[b + self.bs] = self.grow_count.get(b + self.bs, 0) + g
            self.unapplied_grows += g  # counted, and applied at once by _start
        self.grow_frontier = b + 1
        self._start(b, mixed=True)
        budget = step.budget
        # Their tiers matter only where a tier has a target (the tightest one present is kept).
        tiers = ([t for t, k in self.tiers.items() if k]
                 if any(t is not None for t in budget.targets_s) else ())
        add_held_rows(step, self.order_base, tiers, offset=b)
        self.begun = True
        return self.alive

    def give_back(self, step: PassBuilder) -> None:
        """DecodeBatch's hook before a preemption ranks the rows: up to date, emitted first
        in this pass if it had begun (their budget is counted), and no longer this stretch's."""
        self._bring_up(self.applied)
        if self.begun:
            rows = self.rows
            emit_given_back(step, [rows[i] for i in self.order], self.kv.block_ids)
        self.dead = True

    def end_mixed(self, latency: float) -> list[Request]:
        """A mixed pass ended (the clock is at its end): the rows' registrations and finishes,
        before the scheduler's update_from_output for the other rows (their order in the
        pass). The scheduler accounted for the pass and observed its cost."""
        assert self.begun and not self.dead
        self.begun = False
        j = self.applied + 1
        self.times.append(self.clock.now)
        self.lat.append(latency)
        self.pass_rows.append(self.alive)
        self.context += self.alive
        self.pass_context.append(self.context)
        self.planned = self.applied = j
        finished: list[Request] = []
        if j in self.on_end:
            self._apply_end(j, finished)
        return finished

    def absorb(self, num_inbox: int) -> bool:
        """After a mixed pass: if every other running row now decodes and nothing waits, take
        them in (at this boundary) and plan pure-decode passes again; False: not yet."""
        sched = self.sched
        if not can_stretch(sched, num_inbox, skip=self.alive):
            return False
        b = self.applied
        bs, caching, held = self.bs, self.caching, self.kv.req_blocks
        joining = sched.running[self.alive:]
        growing = self.grow_count.get(b, 0) + sum(
            len(held.get(req.request_id, ())) * bs == req.num_computed_tokens for req in joining)
        if growing > self.kv.pool.num_free_blocks:
            return False  # the next pass would preempt: the scheduler's, rows given back
        max_len = model_len_limit(sched.config, self.kv)
        for req in joining:
            i = len(self.rows)
            self.rows.append(req)
            num_output = len(req.output_token_ids)
            base = req.num_computed_tokens - b  # the row's position at boundary 0, virtually
            finish = b + max(1, min(req.sampling_params.max_tokens - num_output,
                                    max_len - len(req.prompt_token_ids) - num_output))
            self.base.append(base)
            self.at.append(b)
            self.finish_at.append(finish)
            g = len(held.get(req.request_id, ())) * bs - base
            self.first_grow.append(g)
            if g < finish:
                self.on_start.setdefault(g, []).append(i)
                self.grow_count[g] = self.grow_count.get(g, 0) + 1
            nxt = min(finish, b + 1 + (-(base + b + 1)) % bs) if caching else finish
            self.on_end.setdefault(nxt, []).append(i)
            heapq.heappush(self.finishes, (finish, i))
            self.context += base + b
            self.alive += 1
            self.order.append(i)
            self.order_base.append(base)
            self.tiers[req.priority] = self.tiers.get(req.priority, 0) + 1
        self.mixed = False
        sched.decode_batch = EAGER_DECODES
        self.look_ahead = FIRST_PLAN_PASSES
        return True

    def _start(self, boundary: int, mixed: bool = False) -> None:
        """The start of pass boundary+1: rows at a block boundary get their next block (in a
        mixed pass the scheduler counts the step and begins it itself)."""
        self.started = boundary
        if not mixed:
            self.sched.num_steps += 1
            self.kv.begin_step()  # as schedule() does: host blocks a swap-in read are free
        rows = self.on_start.pop(boundary, None)
        if not rows:
            return
        nxt = boundary + self.bs
        finish_at, at, all_rows = self.finish_at, self.at, self.rows
        later = None
        if len(rows) > 1:
            rows.sort()
        growing = []
        for i in rows:  # once per row per block it grows by: its tokens brought up, inline
            req = all_rows[i]
            k = boundary - at[i]
            if k:
                req.num_computed_tokens += k
                req.output_token_ids.extend([TOKEN] * k)
                at[i] = boundary
            growing.append(req)
            if nxt < finish_at[i]:
                if later is None:
                    later = self.on_start.setdefault(nxt, [])
                later.append(i)
        # allocate(req, 1) for each, in running order (the pool refuses if planned growth
        # found it short)
        self.kv.grow_by_one_block(growing)
        self.unapplied_grows -= len(rows)

    def _drop(self, i: int, j: int) -> None:
        """Row i finished at boundary j (the plan stops at every finish, so j == planned)."""
        f, k = heapq.heappop(self.finishes)
        assert (f, k) == (j, i) and j == self.planned
        self.alive -= 1
        self.context -= self.base[i] + j
        self.tiers[self.rows[i].priority] -= 1
        self.rows[i] = None  # type: ignore[call-overload]  # a finished request is not kept
        at = self.order.index(i)
        del self.order[at], self.order_base[at]
        g0 = self.first_grow[i]
        if g0 < j:  # its one pending planned growth, at or past the frontier, is void
            g = g0 + max(0, -(-(self.grow_frontier - g0) // self.bs)) * self.bs
            self.grow_count[g] -= 1
