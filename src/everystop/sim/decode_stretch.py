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
before it, and an arrival routed here ends the stretch with the pass it arrived in; the next
pass is then scheduled for real. A pass that would run the pool dry (the scheduler would
preempt) also ends the stretch before it starts.

NOTE: the step-cost fit (`Scheduler.step_cost`) is replayed pass by pass only when a TPOT target
is on, the one case where it steers a decision (the prefill budget); with every target off it
decides nothing, and its coefficients (reported in `Scheduler.stats()`) then reflect only the
passes the scheduler ran itself (as does `Scheduler.last_prefill_budget_tokens`).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Callable

from everystop.core.intake import model_len_limit
from everystop.core.request import Request, RequestStatus
from everystop.core.scheduler import Scheduler
from everystop.core.step_budget import tier_targets_s
from everystop.core.step_cost import StepShape
from everystop.sim.cost_model import IterationShape
from everystop.sim.sim_executor import SimClock, SimExecutor

TOKEN = SimExecutor.SAMPLED_TOKEN
# How many passes a plan looks ahead at first (then doubling): an arrival usually ends a stretch
# within a few passes, and the pass times planned past it are thrown away.
FIRST_PLAN_PASSES = 8


def can_stretch(sched: Scheduler, num_inbox: int) -> bool:
    """Whether the replica's next pass is pure decode with nothing that could join it."""
    if (num_inbox or not sched.running or sched.waiting or sched.preempted or sched.swapped
            or sched.config.scheduling != "continuous" or sched.oom_seat_cap.limit is not None
            or len(sched.running) > sched.num_seats):
        return False
    running = RequestStatus.RUNNING
    # Newest first: a prompt still mid-prefill (the usual reason to say no once the queues are
    # empty) was admitted last, so the scan stops at once rather than after every decode row.
    for req in reversed(sched.running):
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
    called once per pass, in order, as its end is applied."""

    def __init__(self, sched: Scheduler, clock: SimClock,
                 latency_fn: Callable[[IterationShape], float],
                 account: Callable[[float], None]) -> None:
        self.sched, self.kv, self.clock = sched, sched.kv, clock
        self.latency_fn, self.account = latency_fn, account
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
        n, bs, latency_fn = self.alive, self.bs, self.latency_fn
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
                self.grow_frontier = j
            ctx += n
            dt = latency_fn(IterationShape(n, n, 0, ctx, ctx, n))
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
        sched, kv, bs = self.sched, self.kv, self.bs
        for j in range(self.applied + 1, boundary + 1):
            if self.started < j - 1:
                self._start(j - 1)
            self.applied = j
            dt = self.lat[j]
            self.account(dt)
            if self.replay_fit:
                sched.step_cost.observe(StepShape(0, self.pass_rows[j], self.pass_context[j]), dt)
            rows = self.on_end.pop(j, None)
            if not rows:
                continue
            self.clock.now = self.times[j]
            # NOTE: once per row per block it fills, so inline: the row's tokens are brought up
            # to j (`at`), then it is filed under its next pass end that touches it.
            caching, base, finish_at, at, all_rows = (self.caching, self.base, self.finish_at,
                                                      self.at, self.rows)
            on_end = self.on_end
            if len(rows) > 1:
                rows.sort()
            for i in rows:
                req = all_rows[i]
                k = j - at[i]
                if k:
                    req.num_computed_tokens += k
                    req.output_token_ids.extend([TOKEN] * k)
                    at[i] = j
                if caching and (base[i] + j) % bs == 0:
                    kv.cache_computed_blocks(req)
                if j == finish_at[i]:
                    sched.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
                    finished.append(req)
                    self._drop(i, j)
                else:
                    nxt = finish_at[i]
                    if caching:
                        nxt = min(nxt, j + 1 + (-(base[i] + j + 1)) % bs)
                    on_end.setdefault(nxt, []).append(i)
        if start_next and self.started < boundary:
            self._start(boundary)
        return finished

    def close(self, boundary: int) -> None:
        """The stretch ends at `boundary` (its pass end applied): rows brought up to it."""
        assert self.applied == boundary and self.started < boundary
        tokens = TOKEN
        for req, finish, at in zip(self.rows, self.finish_at, self.at):  # rows still running
            if finish > boundary and at < boundary:
                req.num_computed_tokens += boundary - at
                req.output_token_ids.extend([tokens] * (boundary - at))
        self.at = [boundary] * len(self.rows)
        self.clock.now = self.times[boundary]

    def _start(self, boundary: int) -> None:
        """The start of pass boundary+1: rows at a block boundary get their next block."""
        self.started = boundary
        self.sched.num_steps += 1
        self.kv.begin_step()  # as schedule() does: host blocks a swap-in read are free again
        rows = self.on_start.pop(boundary, None)
        if not rows:
            return
        kv, nxt = self.kv, boundary + self.bs
        allocate, finish_at, at, all_rows = kv.allocate, self.finish_at, self.at, self.rows
        later = None
        if len(rows) > 1:
            rows.sort()
        for i in rows:  # once per row per block it grows by: its tokens brought up, inline
            req = all_rows[i]
            k = boundary - at[i]
            if k:
                req.num_computed_tokens += k
                req.output_token_ids.extend([TOKEN] * k)
                at[i] = boundary
            grew = allocate(req, 1)
            assert grew, "planned growth found the pool short"
            if nxt < finish_at[i]:
                if later is None:
                    later = self.on_start.setdefault(nxt, [])
                later.append(i)
        self.unapplied_grows -= len(rows)

    def _drop(self, i: int, j: int) -> None:
        """Row i finished at boundary j (the plan stops at every finish, so j == planned)."""
        f, k = heapq.heappop(self.finishes)
        assert (f, k) == (j, i) and j == self.planned
        self.alive -= 1
        self.context -= self.base[i] + j
        g0 = self.first_grow[i]
        if g0 < j:  # its one pending planned growth, at or past the frontier, is void
            g = g0 + max(0, -(-(self.grow_frontier - g0) // self.bs)) * self.bs
            self.grow_count[g] -= 1
