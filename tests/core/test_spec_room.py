"""When speculation yields a pass to prompts on their way (core/spec_room.py): the arrival
rate, and the passes a burst of arrivals keeps plain."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from everystop.core.arrival_rate import ARRIVAL_MEMORY_S, ArrivalRate
from everystop.core.spec_room import ARRIVAL_LIKELY
from everystop.core.step_cost import StepShape

from .helpers import make_harness
from .test_spec_sizing import FakeStepCost, ngram_harness
from .test_speculation import OracleProposer


def test_arrivals_at_once_read_as_their_count_over_the_memory_and_fade_by_e() -> None:
    rate = ArrivalRate(memory_s=0.5)
    assert rate.rate(0.0) == 0.0 and rate.expected(0.0, 1.0) == 0.0
    for _ in range(4):
        rate.note(10.0)
    assert rate.rate(10.0) == pytest.approx(8.0)
    assert rate.rate(10.5) == pytest.approx(8.0 / math.e)
    assert rate.expected(10.5, 0.25) == pytest.approx(2.0 / math.e)
    assert rate.rate(9.0) == pytest.approx(8.0)  # no growth looking back before the latest


def test_a_memory_must_be_positive() -> None:
    with pytest.raises(ValueError, match="memory_s"):
        ArrivalRate(memory_s=0.0)


@settings(max_examples=100, deadline=None)
@given(times=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=20),
       later=st.floats(0.0, 3.0), memory=st.floats(0.01, 2.0))
def test_the_rate_is_each_arrivals_decayed_share_in_any_order(times, later, memory) -> None:
    """Arrivals noted in any order (a request dated before the latest) give the rate
    sum(exp(-(now - t) / memory)) / memory after the last of them, falling as time passes."""
    in_order, shuffled = ArrivalRate(memory), ArrivalRate(memory)
    for t in sorted(times):
        in_order.note(t)
    for t in times:
        shuffled.note(t)
    now = max(times) + later
    want = sum(math.exp(-(now - t) / memory) for t in times) / memory
    assert in_order.rate(now) == pytest.approx(want, rel=1e-9)
    assert shuffled.rate(now) == pytest.approx(want, rel=1e-9)
    assert shuffled.rate(now + 0.1) <= shuffled.rate(now)


def _decoding(num_seats: int = 64):
    """One sequence decoding alone, long after it arrived, with an oracle that proposes 4
    tokens always (a memory-bound pass: 30 ms)."""
    h = ngram_harness(max_num_seqs=num_seats)
    h.clock.now += 10 * ARRIVAL_MEMORY_S
    assert h.step()[0].num_draft_tokens == 4
    return h


def test_a_burst_of_arrivals_keeps_the_passes_plain_until_it_has_faded() -> None:
    """Eight requests arrive at once and are all admitted in one pass: no prompt is in line
    after it, but more arrivals are likely (the rate says about 32 a second, a pass takes
    30 ms), so the decoding rows run plain until the rate has decayed below an even chance of
    one arrival per pass; then they all speculate."""
    h = _decoding()
    for i in range(8):
        h.add(f"b{i}", [7 + i, 8, 9], max_tokens=400)
    sched, _ = h.step()
    assert sched.num_draft_tokens == 0 and sched.num_prefill_tokens == 24
    plain = 0
    while (sched := h.step()[0]).num_draft_tokens == 0:
        plain += 1
    assert plain > 0
    assert [row.num_draft_tokens for row in sched.scheduled] == [4] * 9
    # The rate fell below an even chance of an arrival during the pass (30 ms) only then:
    # 8 / memory arrivals a second, decaying by e per memory; the harness steps 10 ms.
    fade_s = ARRIVAL_MEMORY_S * math.log(8 / ARRIVAL_MEMORY_S * 0.030 / ARRIVAL_LIKELY)
    assert plain == pytest.approx(fade_s / 0.01, abs=1.5)


def test_a_lone_arrival_leaves_speculation_on_once_its_prompt_is_through() -> None:
    h = _decoding()
    h.add("one", [7, 8, 9], max_tokens=400)
    assert h.step()[0].num_draft_tokens == 0  # its prompt is in line
    assert [row.num_draft_tokens for row in h.step()[0].scheduled] == [4, 4]


def test_arrivals_with_no_seat_free_leave_speculation_on() -> None:
    """Every seat taken: an arrival could not start this pass anyway."""
    h = _decoding(num_seats=1)
    for i in range(8):
        h.add(f"b{i}", [7 + i, 8, 9], max_tokens=400)
    assert h.step()[0].num_draft_tokens == 4


def _memory_bound_cpu(shape: StepShape) -> float:
    """40 ms a pass and 0.4 ms a query row: 16 rows decode in 46 ms, with 4 guesses each in
    72 ms."""
    return 0.040 + 0.0004 * (shape.num_prefill_tokens + shape.num_decode_rows)


def _straggler_ttft(speculative: str, guard: bool = True) -> tuple[float, int]:
    """16 requests arrive at once, a 17th about 200 ms later, just as a pass starts (added
    when that pass ends, as the engine adds it): the straggler's time to first token, and
    the proposals the run verified."""
    h = make_harness(speculative=speculative, num_speculative_tokens=4, num_blocks=8192,
                     max_num_seqs=64, max_num_batched_tokens=2048, chunk_size=512,
                     cost_fn=_memory_bound_cpu,
                     step_cost=FakeStepCost(_memory_bound_cpu, per_token=0.0004))
    if speculative != "off":
        h.scheduler.proposer = OracleProposer(0.2, seed=3, always_k=True)
    if not guard:
        h.scheduler.arrivals = ArrivalRate(memory_s=1e-9)  # forgets every arrival at once
    for i in range(16):
        h.add(f"b{i}", [3 + i, 4, 5, 6, 7, 8, 9, 10], max_tokens=200)
    while h.clock.now < 1.200:  # the harness's clock starts at 1 s
        h.step()
    late_at = h.clock.now  # it arrives as a pass starts, and is added once that pass ends
    h.step()
    late = h.add("late", [40, 41, 42, 43, 44, 45, 46, 47], max_tokens=200)
    late.arrival_time = late_at
    while not h.outputs["late"]:
        h.step()
    ttft = h.clock.now - late_at  # the clock stands at the end of the pass that gave it
    for _ in range(50):
        h.step()
    return ttft, h.scheduler.num_draft_tokens


def test_a_straggler_after_a_burst_waits_no_longer_than_with_speculation_off() -> None:
    """The burst's rows decode while the straggler is on its way: with the guard their
    passes stay plain until the rate has faded, so it waits behind a pass no longer than
    off's and its first token comes as soon; without it, behind a speculative pass, later.
    The rows speculate once the rate has faded."""
    off, _ = _straggler_ttft("off")
    guarded, drafts = _straggler_ttft("ngram")
    unguarded, _ = _straggler_ttft("ngram", guard=False)
    assert guarded == pytest.approx(off, abs=1e-9)
    assert unguarded > off + 0.010
    assert drafts > 0
