"""The decode-batch seam (core/decode_batch.py): rows held in bulk join a pass exactly as the
scheduler's decode loop would add them one by one, and come back as its first decode rows."""

from __future__ import annotations

import pytest

from everystop.core.decode_batch import EAGER_DECODES, add_held_rows, emit_given_back
from everystop.core.outputs import SchedulerOutput
from everystop.core.pass_builder import PassBuilder
from everystop.core.request import Request, RequestStatus
from everystop.core.step_budget import StepBudget
from everystop.core.step_cost import StepCoefficients, StepShape
from everystop.sampling_params import SamplingParams

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
