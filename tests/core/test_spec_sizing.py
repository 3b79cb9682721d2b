"""The speculation sizing rule (core/spec_sizing.py) with no model: a scheduler over the toy
executor, an always-k oracle proposer and a fake step cost, and the rule on its own."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from everystop.core.spec_sizing import (
    PROBE_INTERVAL,
    SizingRow,
    SpecSizer,
    expected_tokens,
)
from everystop.core.step_cost import StepCoefficients, StepCostModel, StepShape

from .helpers import make_harness
from .test_speculation import BatchOracle, OracleProposer


class FakeStepCost(StepCostModel):
    """A step cost that predicts `fn(shape)` and learns nothing (the budget's coefficients are
    a fixed prior)."""

    def __init__(self, fn: Callable[[StepShape], float], per_token: float = 1e-5) -> None:
        super().__init__(StepCoefficients(0.01, per_token, per_token, 0.0))
        self.fn = fn

    def predict(self, shape: StepShape) -> float:
        return self.fn(shape)

    def observe(self, shape: StepShape, seconds: float) -> None:
        pass


def memory_bound(shape: StepShape) -> float:
    """A large per-pass cost (the weights read), rows nearly free."""
    return 0.030 + 1e-5 * (shape.num_prefill_tokens + shape.num_decode_rows)


def compute_bound(shape: StepShape) -> float:
    """Almost all the cost is per row: a proposal costs what a plain row does."""
    return 0.001 + 0.010 * (shape.num_prefill_tokens + shape.num_decode_rows)


def moderate(shape: StepShape) -> float:
    """10 ms per pass and 1 ms per row: one sequence's proposal pays above acceptance 1/11."""
    return 0.010 + 0.001 * (shape.num_prefill_tokens + shape.num_decode_rows)


def roofline(shape: StepShape) -> float:
    """The larger of reading the weights (30 ms) and the rows' compute (1 ms each)."""
    return max(0.030, 0.001 * (shape.num_prefill_tokens + shape.num_decode_rows))


def spec_run(cost: Callable[[StepShape], float], *, wrong: float = 0.0, num_seqs: int = 1,
             k: int = 4, steps: int = 6):
    """A harness of `num_seqs` decoding sequences, run `steps` passes after their prompts;
    returns it and the draft count of each pass's rows, pass by pass."""
    h = make_harness(speculative="ngram", num_speculative_tokens=k, num_blocks=4096,
                     max_num_seqs=max(num_seqs, 4), max_num_batched_tokens=8192,
                     step_cost=FakeStepCost(cost))
    h.scheduler.proposer = OracleProposer(wrong, seed=1, always_k=True)
    for i in range(num_seqs):
        h.add(f"r{i}", [3 + i, 4, 5, 6], max_tokens=400)
    h.step()  # the prompts
    drafts = []
    for _ in range(steps):
        sched, _ = h.step()
        drafts.append([row.num_draft_tokens for row in sched.scheduled])
    return h, drafts


def test_expected_tokens_is_the_geometric_sum() -> None:
    for a in (0.0, 0.3, 0.8, 0.99):
        for k in range(6):
            assert expected_tokens(a, k) == pytest.approx(sum(a ** j for j in range(k + 1)))
    assert expected_tokens(1.0, 4) == 5.0


def test_a_memory_bound_pass_verifies_every_proposal_an_accepting_sequence_may_take() -> None:
    h, drafts = spec_run(memory_bound, k=4)
    assert drafts == [[4]] * len(drafts)
    stats = h.scheduler.stats()
    assert stats.spec_decode_mean_k == 4.0 and stats.spec_decode_num_sized_off == 0


def test_a_compute_bound_pass_does_not_speculate() -> None:
    h, drafts = spec_run(compute_bound, num_seqs=3)
    assert drafts == [[0, 0, 0]] * len(drafts)
    stats = h.scheduler.stats()
    assert stats.spec_decode_num_draft_tokens == 0
    assert stats.spec_decode_num_sized_off == 3 * len(drafts)
    assert stats.spec_decode_mean_k == 0.0


def test_low_acceptance_sizes_a_sequence_off_and_a_probe_checks_it_again() -> None:
    _, good = spec_run(moderate, wrong=0.0)
    assert good[0][0] > 0  # at the prior rate
    assert good[1:] == [[4]] * (len(good) - 1)  # once its proposals were accepted
    h, drafts = spec_run(moderate, wrong=1.0, steps=2 * PROBE_INTERVAL + 8)
    per_pass = [row[0] for row in drafts]
    assert per_pass[0] > 0  # the prior lets it try
    off = per_pass.index(0)
    assert off <= 10  # rejected proposals drive its estimate down within ten passes
    # sized off thereafter, but for one proposal every PROBE_INTERVAL passes
    tail = per_pass[off:]
    assert set(tail) == {0, 1}
    probes = [i for i, n in enumerate(tail) if n]
    assert probes and all(b - a == PROBE_INTERVAL for a, b in zip(probes, probes[1:]))
    assert h.scheduler.spec_sizer.acceptance("r0") < 1 / 11
    assert h.scheduler.stats().spec_decode_num_accepted_tokens == 0


def test_speculation_turns_off_as_the_batch_grows_compute_bound() -> None:
    _, small = spec_run(roofline, num_seqs=2, steps=3)
    _, large = spec_run(roofline, num_seqs=40, steps=3)
    assert all(k > 0 for row in small for k in row)
    assert all(k == 0 for row in large for k in row)


def test_the_rule_takes_proposals_while_they_beat_the_pass_rate() -> None:
    """Two rows in an otherwise empty pass: 4 ms fixed, 1 ms per row, acceptance 0.7. The
    pass starts at 2 tokens in 6 ms; proposals worth 0.7 (a), 0.7 (b: its cap), 0.49 (a)
    each beat the rate so far (0.33, 0.39, 0.43 tokens per ms) and cost 1 ms; the next,
    0.343 (a), does not beat 3.89 tokens in 9 ms."""
    sizer = SpecSizer(initial_acceptance=0.7)

    def cost(shape: StepShape) -> float:
        return 0.004 + 0.001 * (shape.num_decode_rows + shape.num_prefill_tokens)

    assert sizer.choose([SizingRow("a", 8), SizingRow("b", 1)], StepShape(0, 2, 20),
                        cost) == [2, 1]
    assert sizer.last_num_rows == 2 and sizer.last_num_proposals == 3


def test_acceptance_estimates_start_at_the_global_rate_and_follow_each_sequence() -> None:
    sizer = SpecSizer(initial_acceptance=0.6)
    assert sizer.acceptance("new") == pytest.approx(0.6)
    for _ in range(20):
        sizer.observe("good", 4, 4)
        sizer.observe("bad", 4, 0)
    assert sizer.acceptance("good") > 0.9
    assert sizer.acceptance("bad") < 0.15
    assert 0.6 < sizer.global_acceptance < 0.9  # 80 kept of 80 + 20 trials, plus the prior
    assert sizer.acceptance("unseen") == pytest.approx(sizer.global_acceptance)
    sizer.forget("bad")
    assert sizer.acceptance("bad") == pytest.approx(sizer.global_acceptance)


def test_decisions_are_logged_when_they_change(caplog: pytest.LogCaptureFixture) -> None:
    sizer = SpecSizer(initial_acceptance=0.9)
    rows, base = [SizingRow("a", 3)], StepShape(0, 1, 10)
    with caplog.at_level(logging.DEBUG, logger="everystop.core.spec_sizing"):
        assert sizer.choose(rows, base, memory_bound) == [3]
        assert sizer.choose(rows, base, memory_bound) == [3]
        assert sizer.choose(rows, base, compute_bound) == [0]
    changes = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(changes) == 2 and "k 3 -> 0" in changes[1]


def test_an_info_summary_is_logged_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    sizer = SpecSizer(initial_acceptance=0.9)
    rows, base = [SizingRow("a", 3), SizingRow("b", 3)], StepShape(0, 2, 10)
    with caplog.at_level(logging.INFO, logger="everystop.core.spec_sizing"):
        for now in (0.0, 30.0, 59.0):
            sizer.choose(rows, base, memory_bound, now)
        assert not caplog.records
        sizer.choose(rows, base, compute_bound, 60.0)
    (summary,) = [r.getMessage() for r in caplog.records]
    assert "4 passes, 8 rows, mean k 2.25, 2 sized off" in summary


def _target(shape: StepShape) -> float:
    """10 ms a pass, 0.5 ms a row or query token."""
    return 0.010 + 0.0005 * (shape.num_decode_rows + shape.num_prefill_tokens)


def _draft(shape: StepShape) -> float:
    """4 ms a pass, 0.5 ms a fed token."""
    return 0.004 + 0.0005 * (shape.num_decode_rows + shape.num_prefill_tokens)


def test_a_draft_catch_up_is_charged_spread_over_the_passes_the_row_may_still_run() -> None:
    """A 200-token context the draft has not seen costs 99.5 ms of draft prefill. At
    acceptance 0.8 and cap 4 a pass gives the row 3.36 tokens, so 64 tokens to come are 19
    passes (5.2 ms each): three proposals still pay (2.95 tokens in 30.7 ms beats 1 in
    10.5 ms); 32 tokens to come are 9.5 passes (10.4 ms each) and none does, nor over the
    last 4. Caught up, the same row speculates with 4 tokens to go."""
    sizer = SpecSizer(initial_acceptance=0.8)
    base = StepShape(0, 1, 201)

    def ks(unseen: int, remaining: int) -> list[int]:
        return sizer.choose([SizingRow("a", 4, 200, unseen, remaining)], base, _target,
                            draft=_draft)

    assert ks(200, 64)[0] > 0
    assert ks(200, 32) == [0]
    assert ks(200, 4) == [0]
    assert ks(1, 4)[0] > 0
    assert ks(200, 4000)[0] > 0  # never spread wider than CATCH_UP_HORIZON passes
    assert sizer.choose([SizingRow("a", 4, 200, 200, 4)], base, _target) != [0]  # no draft


def test_the_summary_counts_the_draft_catch_ups_it_chose(
        caplog: pytest.LogCaptureFixture) -> None:
    """A row's first draft pass feeds its whole 200-token context (a prompt catch-up); the
    passes after, each following a drafted one, feed the target's token and are no catch-up
    even where all proposals were kept (2 tokens to feed); after a pass sized off, the 3
    tokens the draft missed make a resumed catch-up."""
    sizer = SpecSizer(initial_acceptance=0.8)

    with caplog.at_level(logging.INFO, logger="everystop.core.spec_sizing"):
        k = sizer.choose([SizingRow("a", 4, 200, sizer.unseen("a", 200), 64)],
                         StepShape(0, 1, 201), _target, 0.0, draft=_draft)[0]
        assert k > 0
        sizer.drafted("a", 199)  # the draft was shown the context before the last token
        sizer.observe("a", k, k)  # all kept: it holds K/V for all but the last proposal
        assert sizer.unseen("a", 199 + k + 1) == 2
        assert sizer.choose([SizingRow("a", 4, 200 + k, 2, 64)], StepShape(0, 1, 201 + k),
                            _target, 10.0, draft=_draft)[0] > 0
        assert sizer.choose([SizingRow("a", 4, 300, 1, 64)], StepShape(0, 1, 301),
                            compute_bound, 20.0, draft=_draft) == [0]
        assert sizer.choose([SizingRow("a", 4, 303, 4, 64)], StepShape(0, 1, 304),
                            _target, 60.0, draft=_draft)[0] > 0
    (summary,) = [r.getMessage() for r in caplog.records]
    assert "4 passes, 4 rows" in summary and "1 sized off" in summary
    assert "1 of whole prompts (199 tokens), 1 resumed after passes sized off (3 tokens)" in (
        summary)


def test_the_draft_is_counted_as_having_seen_the_proposals_it_fed_back() -> None:
    """Drafting 4 after 100 tokens feeds d1..d3 back: with 2 kept the verified sequence is 103
    tokens, of which the draft holds 102 (only the target's token is new); with all 4 kept,
    105, of which 103 (d4 and the target's token are new); with none kept, 101 of 100."""
    sizer = SpecSizer()
    for kept, tokens, unseen in ((2, 103, 1), (4, 105, 2), (0, 101, 1)):
        sizer.drafted("s", 100)
        sizer.observe("s", 4, kept)
        assert sizer.unseen("s", tokens) == unseen
    sizer.observe("t", 4, 4)  # never shown to a draft (an n-gram proposer's row)
    assert sizer.unseen("t", 50) == 50


def test_a_row_whose_catch_up_does_not_pay_leaves_the_others_their_proposals() -> None:
    """With a 1 ms draft pass, row `near` (caught up) gains; row `far` would need a
    2,000-token catch-up spread over its last 8 tokens (125 ms): near speculates, far decodes
    plainly, whichever comes first."""
    def cheap_draft(shape: StepShape) -> float:
        return 0.001 + 0.0005 * (shape.num_decode_rows + shape.num_prefill_tokens)

    sizer = SpecSizer(initial_acceptance=0.8)
    for rows in ([SizingRow("far", 4, 2000, 2000, 8), SizingRow("near", 4, 200)],
                 [SizingRow("near", 4, 200), SizingRow("far", 4, 2000, 2000, 8)]):
        ks = dict(zip((r.request_id for r in rows),
                      sizer.choose(rows, StepShape(0, 2, 2202), _target, draft=cheap_draft)))
        assert ks["far"] == 0 and ks["near"] > 0


def test_the_sizer_counts_what_a_draft_model_has_not_seen() -> None:
    sizer = SpecSizer()
    assert sizer.unseen("s", 120) == 120  # never drafted: the whole context
    sizer.drafted("s", 100)
    assert sizer.unseen("s", 103) == 3
    assert sizer.unseen("s", 100) == 1  # the last token is always fed
    sizer.forget("s")
    assert sizer.unseen("s", 103) == 103


def test_a_draft_models_passes_are_priced_so_a_large_batch_does_not_speculate() -> None:
    """Target: 10 ms a pass and 0.5 ms a row; draft pass: 4 ms and 0.5 ms a row. One sequence
    at acceptance 0.8 gains (1.8 tokens in 15.5 ms beats 1 in 10.5 ms); 32 do not (57.6 in
    62 ms loses to 32 in 26 ms), though the same proposals with no draft pass to run (an
    n-gram lookup) would pay."""
    def target(shape: StepShape) -> float:
        return 0.010 + 0.0005 * (shape.num_decode_rows + shape.num_prefill_tokens)

    def draft(shape: StepShape) -> float:
        return 0.004 + 0.0005 * (shape.num_decode_rows + shape.num_prefill_tokens)

    sizer = SpecSizer(initial_acceptance=0.8)
    assert sizer.choose([SizingRow("a", 4, 100)], StepShape(0, 1, 101), target,
                        draft=draft)[0] > 0
    rows = [SizingRow(f"s{i}", 4, 100) for i in range(32)]
    base = StepShape(0, 32, 32 * 101)
    assert sizer.choose(rows, base, target, draft=draft) == [0] * 32
    assert all(k > 0 for k in sizer.choose(rows, base, target))


def _step_12ms(shape: StepShape) -> float:
    """12 ms a pass, 1 ms a row or query token."""
    return 0.012 + 0.001 * (shape.num_decode_rows + shape.num_prefill_tokens)


def _draft_8ms(shape: StepShape) -> float:
    """8 ms a pass, 0.5 ms a row or fed token: most of a target step."""
    return 0.008 + 0.0005 * (shape.num_decode_rows + shape.num_prefill_tokens)


def test_a_draft_costing_most_of_a_step_is_probed_when_its_full_depth_would_pay() -> None:
    """One row, 13 ms a step, 64 tokens to go. At the prior 0.6 drafting does not pay; all
    kept it does (5 tokens in 51 ms plus 11.7 ms of its 300-token catch-up, 149.5 ms over
    12.8 passes, beat 65), though one kept proposal alone does not (2 tokens in 22.5 ms plus
    a catch-up share against 26). So the row is probed after PROBE_INTERVAL passes sized off,
    and with its proposals kept it drafts its cap within a dozen passes more."""
    sizer = SpecSizer()
    context, ks = 300, []
    for _ in range(PROBE_INTERVAL + 12):
        row = SizingRow("a", 4, context, sizer.unseen("a", context), 64)
        [k] = sizer.choose([row], StepShape(0, 1, context + 1), _step_12ms, draft=_draft_8ms)
        if k:
            sizer.drafted("a", context)
            sizer.observe("a", k, k)
        ks.append(k)
        context += k + 1
    assert ks[:PROBE_INTERVAL] == [0] * (PROBE_INTERVAL - 1) + [1]
    assert ks[-1] == 4


def test_no_probe_where_even_a_kept_draft_does_not_pay() -> None:
    """32 rows at 44 ms a pass: four kept proposals of a row would add 38 ms for 4 tokens,
    against 32 tokens in 44 ms: no row is probed, however long sized off."""
    sizer = SpecSizer()
    rows = [SizingRow(f"s{i}", 4, 200, 200, 1000) for i in range(32)]
    for _ in range(3 * PROBE_INTERVAL):
        assert sizer.choose(rows, StepShape(0, 32, 32 * 201), _step_12ms,
                            draft=_draft_8ms) == [0] * 32


def test_a_prompt_in_line_gets_the_pass_before_any_proposal() -> None:
    """1 ms a prefill token against the 100 ms auto target: a 200-token prompt in line needs
    more than the pass has left, so the decoding row gets k = 0 and the prompt the prefill it
    would get with speculation off; once the prompt is through, both rows speculate."""
    def harness(speculative: str):
        h = make_harness(speculative=speculative, num_speculative_tokens=4, num_blocks=4096,
                         max_num_seqs=4, max_num_batched_tokens=8192, chunk_size=512,
                         step_cost=FakeStepCost(memory_bound, per_token=1e-3))
        if speculative != "off":
            h.scheduler.proposer = OracleProposer(0.0, seed=1, always_k=True)
        h.add("r0", [3, 4, 5, 6], max_tokens=400)
        h.step()
        return h

    h, off = harness("ngram"), harness("off")
    sched, _ = h.step()
    assert sched.num_draft_tokens == 4  # alone, it speculates
    off.step()
    for x in (h, off):
        x.add("long", [7] * 200, max_tokens=400)
    sched, _ = h.step()
    plain, _ = off.step()
    assert sched.num_draft_tokens == 0
    assert sched.num_prefill_tokens == plain.num_prefill_tokens > 0
    while h.scheduler.requests["long"].num_computed_tokens < 200:
        h.step()
    sched, _ = h.step()
    assert [row.num_draft_tokens for row in sched.scheduled] == [4, 4]


def ngram_harness(max_num_seqs: int = 4):
    """A harness with one sequence decoding and an oracle that proposes 4 tokens always."""
    h = make_harness(speculative="ngram", num_speculative_tokens=4, num_blocks=4096,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, chunk_size=512,
                     step_cost=FakeStepCost(memory_bound, per_token=1e-6))
    h.scheduler.proposer = OracleProposer(0.0, seed=1, always_k=True)
    h.add("r0", [3, 4, 5, 6], max_tokens=400)
    h.step()
    return h


def test_no_proposal_rides_beside_even_a_short_prompt() -> None:
    """Prefill is nearly free and the target leaves room for every proposal, but any proposal
    would lengthen the pass that gives the new prompt its first token: none is made."""
    h = ngram_harness()
    assert h.step()[0].num_draft_tokens == 4
    h.add("short", [7, 8, 9], max_tokens=400)
    sched, _ = h.step()
    assert sched.num_draft_tokens == 0 and sched.num_prefill_tokens == 3
    sched, _ = h.step()
    assert [row.num_draft_tokens for row in sched.scheduled] == [4, 4]


def test_a_queued_prompt_with_no_seat_free_leaves_speculation_on() -> None:
    """With every seat taken the queued prompt cannot move this pass: the running sequence
    keeps speculating (finishing sooner is what frees the seat)."""
    h = ngram_harness(max_num_seqs=1)
    h.add("queued", [7, 8, 9], max_tokens=400)
    sched, _ = h.step()
    assert sched.num_draft_tokens == 4 and sched.num_prefill_tokens == 0


class IdleCountingOracle(BatchOracle):
    """A batch proposer that counts the passes in which it drafted nothing."""

    def __init__(self) -> None:
        super().__init__(0.0, seed=1, always_k=True)
        self.idle = 0

    def idle_pass(self) -> None:
        self.idle += 1


@pytest.mark.parametrize("cost, idle", [(compute_bound, 6), (memory_bound, 0)])
def test_a_batch_proposer_hears_of_each_pass_it_was_not_asked_to_draft(cost, idle) -> None:
    """Sized off (compute-bound passes) a draft model hears of every pass that ran without
    it, so that it can keep its cost fit fresh; drafting, it hears of none."""
    h = make_harness(speculative="ngram", num_speculative_tokens=4, num_blocks=4096,
                     max_num_seqs=4, max_num_batched_tokens=8192,
                     step_cost=FakeStepCost(cost))
    oracle = h.scheduler.proposer = IdleCountingOracle()
    for i in range(2):
        h.add(f"r{i}", [3 + i, 4, 5, 6], max_tokens=400)
    h.step()
    for _ in range(6):
        h.step()
    assert oracle.idle == idle
    assert len(oracle.batches) == 6 - idle
