"""The decode-batch seam (core/decode_batch.py): rows held in bulk join a pass exactly as the
scheduler's decode loop would add them one by one, and come back as its first decode rows."""

from __future__ import annotations

import pytest

from everystop.core.decode_batch import EAGER_DECODES, add_held_rows, emit_given_back
from everystop.core.outputs import SchedulerOutput
from everystop.core.pass_builder import PassBuilder
from everystop.core.request import Request, RequestStatus
from everystop.core.scheduler import Scheduler
from everystop.core.step_budget import StepBudget
from everystop.core.step_cost import StepCoefficients, StepShape
from everystop.sampling_params import SamplingParams

from .helpers import Harness, make_harness

COEFFS = StepCoefficients(0.0123, 0.00071, 0.00033, 1.7e-7)
TARGETS = (0.05, None, 0.2)


def _decoding(rid: str, prompt_len: int, num_output: int, priority: int = 1) -> Request:
    """A running row whose next pass decodes one token (its last one not yet computed)."""
    req = Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=1000, ignore_eos=True),
                  priority=priority)
    req.output_token_ids = [7] * num_output
    req.num_computed_tokens = prompt_len + num_output - 1
    req.status = RequestStatus.RUNNING
    return req


def _pass(timed: bool = True) -> PassBuilder:
    budget = StepBudget(256, COEFFS if timed else None, TARGETS, floor_tokens=4)
    return PassBuilder(0.0, budget, SchedulerOutput())


def _block_ids(rid: str) -> list[int]:
    return [int(rid[1:]), 100 + int(rid[1:])]


ROWS = [("r0", 30, 5, 2), ("r1", 12, 40, 0), ("r2", 100, 1, 1), ("r3", 7, 9, 2)]


@pytest.mark.parametrize("timed", [True, False])
def test_held_rows_budget_the_pass_as_the_decode_loop_would(timed: bool) -> None:
    rows = [_decoding(*r) for r in ROWS]
    one, bulk = _pass(timed), _pass(timed)
    for req in rows:
        one.emit(req, 1, _block_ids(req.request_id))
    # Positions taken 3 passes ago, and the passes since as the offset (a stretch's bases).
    add_held_rows(bulk, [r.num_computed_tokens - 3 for r in rows], {r.priority for r in rows},
                  offset=3)
    assert not bulk.decodes and not bulk.is_empty
    a, b = one.finish(), bulk.finish()
    assert b.num_bulk_decodes == len(rows) and not b.scheduled
    assert (b.num_decode_tokens, b.predicted_time_s, b.tpot_target_s, b.prefill_budget_tokens) \
        == (a.num_decode_tokens, a.predicted_time_s, a.tpot_target_s, a.prefill_budget_tokens)
    assert StepShape.from_output(b) == StepShape.from_output(a)


def test_rows_given_back_come_first_and_are_not_budgeted_twice() -> None:
    held = [_decoding(*r) for r in ROWS[:2]]
    own = [_decoding(*r) for r in ROWS[2:]]
    eager, bulk = _pass(), _pass()
    for req in held + own:
        eager.emit(req, 1, _block_ids(req.request_id))
    add_held_rows(bulk, [r.num_computed_tokens for r in held], {r.priority for r in held})
    for req in own:  # the scheduler's own rows, after the held ones
        bulk.emit(req, 1, _block_ids(req.request_id))
    emit_given_back(bulk, held, _block_ids)
    a, b = eager.finish(), bulk.finish()
    assert b.num_bulk_decodes == b.bulk_context_tokens == 0
    assert [e.request_id for e in b.scheduled] == ["r0", "r1", "r2", "r3"]
    assert b.scheduled == a.scheduled
    assert (b.num_decode_tokens, b.predicted_time_s, b.tpot_target_s) \
        == (a.num_decode_tokens, a.predicted_time_s, a.tpot_target_s)


def test_eager_default_holds_nothing() -> None:
    step = _pass()
    assert EAGER_DECODES.begin_pass(step) == 0
    EAGER_DECODES.give_back(step)
    assert not EAGER_DECODES.holds_rows and step.is_empty


# -- the scheduler's two calls, against the same scheduler walking every row itself -------------

class HeadRows:
    """A DecodeBatch holding the first `k` running rows for one pass (they are up to date)."""

    holds_rows = True

    def __init__(self, sched: Scheduler, k: int) -> None:
        self.sched, self.rows = sched, list(sched.running[:k])
        self.begun = self.given_back = False

    def begin_pass(self, step: PassBuilder) -> int:
        kv = self.sched.kv
        if not all(kv.allocate(req, 1) for req in self.rows):  # in running order, as step 1
            self.sched.decode_batch = EAGER_DECODES
            self.give_back(step)
            return 0
        add_held_rows(step, [r.num_computed_tokens for r in self.rows],
                      {r.priority for r in self.rows})
        self.begun = True
        return len(self.rows)

    def give_back(self, step: PassBuilder) -> None:
        if self.begun:
            emit_given_back(step, self.rows, self.sched.kv.block_ids)
        self.given_back = True


def _twins(prompts: list[tuple[int, int]], steps: int, max_tokens: int = 30,
           late: tuple[int, int] | None = None, **kwargs: object) -> list[Harness]:
    """Two schedulers with the same history: `prompts` (length, tier) run for `steps` passes,
    `late` (length, tier) arriving after the first."""
    twins = [make_harness(**kwargs) for _ in range(2)]  # type: ignore[arg-type]
    for h in twins:
        for i, (n, tier) in enumerate(prompts):
            h.add(f"r{i}", list(range(10 * i, 10 * i + n)), max_tokens, priority=tier)
        for step in range(steps):
            if late is not None and step == 1:
                h.add("late", list(range(300, 300 + late[0])), max_tokens, priority=late[1])
            h.step()
    return twins


def _same_pass(a: SchedulerOutput, b: SchedulerOutput) -> None:
    assert [e.request_id for e in b.scheduled] == [e.request_id for e in a.scheduled]
    assert b.scheduled == a.scheduled
    assert (b.preempted_request_ids, b.num_decode_tokens, b.num_prefill_tokens,
            b.predicted_time_s, b.tpot_target_s, b.prefill_budget_tokens) \
        == (a.preempted_request_ids, a.num_decode_tokens, a.num_prefill_tokens,
            a.predicted_time_s, a.tpot_target_s, a.prefill_budget_tokens)


def test_held_rows_ride_a_pass_that_admits_a_newcomer() -> None:
    eager, bulk = _twins([(9, 1), (14, 2), (5, 0)], steps=3, tpot_target_ms=40.0)
    for h in (eager, bulk):
        h.add("new", list(range(500, 540)), 5)
    batch = HeadRows(bulk.scheduler, 2)
    bulk.scheduler.decode_batch = batch
    a, b = eager.scheduler.schedule(), bulk.scheduler.schedule()
    assert batch.begun and not batch.given_back and b.num_bulk_decodes == 2
    assert [e.request_id for e in b.scheduled] == [e.request_id for e in a.scheduled[2:]]
    assert b.scheduled == a.scheduled[2:] and b.scheduled[-1].request_id == "new"
    assert (b.num_decode_tokens, b.predicted_time_s, b.tpot_target_s, b.prefill_budget_tokens) \
        == (a.num_decode_tokens, a.predicted_time_s, a.tpot_target_s, a.prefill_budget_tokens)
    assert StepShape.from_output(b) == StepShape.from_output(a)
    assert bulk.scheduler.kv.req_blocks.keys() == eager.scheduler.kv.req_blocks.keys()
    for rid, blocks in eager.scheduler.kv.req_blocks.items():
        assert len(bulk.scheduler.kv.req_blocks[rid]) == len(blocks)


def test_a_better_tier_waiting_for_a_seat_takes_the_rows_back_first() -> None:
    eager, bulk = _twins([(9, 2), (14, 2), (5, 2)], steps=3, max_num_seqs=3)
    for h in (eager, bulk):
        h.add("premium", list(range(500, 520)), 5, priority=0)
    batch = HeadRows(bulk.scheduler, 2)
    bulk.scheduler.decode_batch = batch
    a, b = eager.scheduler.schedule(), bulk.scheduler.schedule()
    assert a.preempted_request_ids and batch.given_back
    assert bulk.scheduler.decode_batch is EAGER_DECODES
    _same_pass(a, b)
    bulk.scheduler.check_integrity()


@pytest.mark.parametrize("num_blocks", [8, 6])  # short for the third row's growth; for all
def test_a_pool_short_for_growth_takes_the_rows_back_before_ranking_victims(
        num_blocks: int) -> None:
    # Blocks of 4: every row needs its third block in the same pass, and the one that finds the
    # pool short is the better tier, which preempts a held row.
    eager, bulk = _twins([(7, 2), (7, 2)], steps=2, max_tokens=4, late=(8, 0),
                         num_blocks=num_blocks, block_size=4, prefix_caching=False)
    assert [r.request_id for r in bulk.scheduler.running] == ["r0", "r1", "late"]
    batch = HeadRows(bulk.scheduler, 2)
    bulk.scheduler.decode_batch = batch
    a, b = eager.scheduler.schedule(), bulk.scheduler.schedule()
    assert batch.given_back and batch.begun == (num_blocks == 8)
    assert a.preempted_request_ids and a.preempted_request_ids[0] in ("r0", "r1")
    assert bulk.scheduler.decode_batch is EAGER_DECODES
    _same_pass(a, b)
    bulk.scheduler.check_integrity()
