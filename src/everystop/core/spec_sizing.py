"""How many proposals each speculating sequence verifies this pass: the k that gives the pass
the most expected tokens per predicted second, from measured acceptance and the fitted step
cost (core/step_cost.py).

Acceptance. Each sequence's per-position acceptance a: core/spec_acceptance.py.

Expected tokens. A row with k proposals gives 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)
tokens: its j-th proposal adds a^j.

The rule. The pass's decode rows alone give S tokens (one each) in T0 = predict(pass) seconds.
Proposals are taken in order of expected value a^j, each only while it raises the pass's
expected tokens per second:

    (S + a^j) / predict(pass + that row) > S / T    <=>    a^j / dT > S / T

(dT: the predicted time the extra row adds). So a proposal is verified when the tokens it is
expected to give per second it adds beat the pass's rate so far; the sequences whose first
proposal does not pay get k = 0 and decode plainly. While the batch is memory-bound a row
costs little next to the pass's fixed cost, S / T is low and proposals pay; as the batch
grows compute-bound, S / T rises toward one token per row's cost, which a proposal (worth
a^j < 1, costing about a row) cannot beat, and speculation turns itself off.

Draft passes. A draft model (executor/draft_proposer.py) runs one pass of its own per
proposal depth, over the rows that go that deep, priced by its own fitted cost: T counts
them too, a plan of D passes pays their fixed cost up front, and a proposal at depth j adds
its row to draft pass j as well. Each D from 1 to the largest cap is sized as above and the
plan with the most tokens per second wins (none: k = 0 everywhere), so a large batch, whose
draft passes cost about what the rows they save do, does not speculate.

Catch-up. A draft model holds K/V only for the tokens it was shown: a sequence it has not
drafted for since its last `unseen - 1` tokens (its whole prompt, if never) has them fed in
its first draft pass, a prefill the sequence's first proposal is charged for. It buys every
later proposal of the sequence, so it is spread over the passes it serves: the tokens the
row may still emit, at most CATCH_UP_HORIZON, over the tokens a pass gives it at its
acceptance and cap (expected_tokens(a, cap): a row that takes 3 tokens a pass runs a third
as many passes as it has tokens to go). A sequence sized off is not caught up (no
draft pass runs for it); a long prompt in a large batch stays undrafted. The info summary
counts the catch-ups chosen, those of whole prompts (never drafted) apart from those resumed
after passes sized off; a row drafted the pass before feeds only the target's token (and its
last proposal, when all were kept): drafting's own step, no catch-up.

Prompts in line. A pass that could prefill a prompt takes no proposal at all
(core/spec_room.py): the rule sizes the passes whose rows are all decoding.

Probing. A sequence sized off keeps no fresh evidence, so every PROBE_INTERVAL of its passes it
verifies one proposal, if its proposals at acceptance 1 would pay at the pass's rate at some
depth up to its cap (never in a compute-bound pass): an estimate that was low recovers when the
text turns copyable. The depth matters for a draft model whose pass costs most of a target
step: its catch-up is spread over a pass's proposals, so one kept proposal may not pay where a
cap of them does (a 13 ms step, 1 ms a query, 8.5 ms draft passes, 11.7 ms of catch-up a
pass: one gives 2 tokens in 34.2 ms against 26 plain, four give 5 in 62.7 against 65). The probe
itself verifies one proposal, the cheapest evidence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from everystop.core.spec_acceptance import INITIAL_ACCEPTANCE, AcceptanceEstimates, SeqState
from everystop.core.step_cost import StepShape

logger = logging.getLogger(__name__)

PROBE_INTERVAL = 16  # passes a sized-off sequence waits before verifying one proposal
CATCH_UP_HORIZON = 128  # the most tokens to come a draft catch-up is spread over (an answer
# often runs 100-250 tokens)
SUMMARY_INTERVAL_S = 60.0  # how often the info summary is logged (scheduler clock)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a row with k proposals gives on average: (1 - a^(k+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass(frozen=True)
class SizingRow:
    """A decode row that may speculate: its request, the most proposals it may take, its
    context length (what a draft pass's row reads), the tokens a draft pass must feed for it
    (1 when the draft has seen all but the last) and the tokens it may still emit."""

    request_id: str
    cap: int
    context: int = 0
    unseen: int = 1
    remaining: int = CATCH_UP_HORIZON


@dataclass
class _Plan:
    """A choice of ks: the pass's shape with them, its predicted seconds (draft passes
    included), the expected tokens, and each draft pass's shape."""

    ks: list[int]
    shape: StepShape
    time_s: float
    tokens: float
    passes: list[StepShape]


def _one_more_query(shape: StepShape) -> StepShape:
    """`shape` with one more verified proposal: a query token of a row already counted."""
    return StepShape(shape.num_prefill_tokens + 1, shape.num_decode_rows,
                     shape.context_tokens + 1)


def _catch_up_s(row: SizingRow, draft: Callable[[StepShape], float], empty_s: float,
                tokens_per_pass: float) -> float:
    """The draft's prefill of the row's unseen tokens before its last (beyond `empty_s`, an
    empty pass), spread over the passes the row may still run: the tokens it may still emit
    (at most CATCH_UP_HORIZON), each pass giving it `tokens_per_pass`."""
    if row.unseen <= 1:
        return 0.0
    horizon = max(1.0, min(row.remaining, CATCH_UP_HORIZON) / max(tokens_per_pass, 1.0))
    return (draft(StepShape(row.unseen - 1, 0, 0)) - empty_s) / horizon


def _catch_up_blocks(value: float, time_s: float, tokens: float, added: float,
                     catch_up: float) -> bool:
    """Whether a row's proposal worth `value` tokens, adding `added` seconds plus its
    `catch_up`, is passed over for the catch-up: it has one and does not pay at the rate
    tokens / time_s. Another row's proposal, whose draft has less to catch up, may still pay,
    so the search goes on past it."""
    return catch_up > 0.0 and value * time_s <= tokens * (added + catch_up)


def _one_more_row(shape: StepShape, context: int) -> StepShape:
    """A draft pass's `shape` with one more row, reading `context` tokens."""
    return StepShape(shape.num_prefill_tokens, shape.num_decode_rows + 1,
                     shape.context_tokens + context + 1)


def _candidates(rows: Sequence[SizingRow], accs: Sequence[float]
                ) -> list[tuple[float, int, int]]:
    """Every proposal a row may take, (expected value, row, depth), highest value first (a
    stable sort: a row's proposals stay in order, and so in any subset of them)."""
    out = []
    for i, (row, a) in enumerate(zip(rows, accs)):
        value = 1.0
        for j in range(row.cap):
            value *= a
            if value <= 0.0:
                break
            out.append((value, i, j))
    out.sort(key=lambda c: -c[0])
    return out


def _certain_pays(row: SizingRow, plan: _Plan, predict: Callable[[StepShape], float],
                  draft: Callable[[StepShape], float] | None) -> tuple[bool, bool]:
    """Whether the row's proposals at acceptance 1, at the best depth up to its cap, beat the
    rate of `plan`: leaving out its draft catch-up, and with it (spread as at acceptance 1:
    each pass gives the row cap + 1 tokens)."""
    time_s, tokens = plan.time_s, plan.tokens
    catch_up = (_catch_up_s(row, draft, draft(StepShape()), expected_tokens(1.0, row.cap))
                if draft is not None else 0.0)
    shape, shape_s, added, certain = plan.shape, predict(plan.shape), 0.0, False
    for j in range(row.cap):
        grown = _one_more_query(shape)
        grown_s = predict(grown)
        added += grown_s - shape_s
        shape, shape_s = grown, grown_s
        if draft is not None:  # the row in draft pass j: one the plan runs, or a new one
            held = plan.passes[j] if j < len(plan.passes) else None
            added += draft(_one_more_row(held or StepShape(), row.context)) - (
                draft(held) if held is not None else 0.0)
        # j + 1 kept proposals for `added` seconds against the rate tokens / time_s
        certain = certain or (j + 1) * time_s > tokens * added
        if (j + 1) * time_s > tokens * (added + catch_up):
            return True, True
    return certain, False


class SpecSizer(AcceptanceEstimates):
    """The sizing rule over the acceptance estimates; counts what it chose."""

    def __init__(self, initial_acceptance: float = INITIAL_ACCEPTANCE) -> None:
        super().__init__(initial_acceptance)
        # What /metrics shows: sequence-passes sized to k = 0, and the latest sizing's rows
        # and proposals chosen (their ratio: the mean k).
        self.num_sized_off = 0
        self.last_num_rows = 0
        self.last_num_proposals = 0
        # Since the last log: passes, rows, proposals, sized off, and the draft catch-ups
        # chosen (module docstring) with their tokens: of whole prompts, and resumed.
        self._summary = [0] * 8
        self._summary_since: float | None = None

    def choose(self, rows: Sequence[SizingRow], base: StepShape,
               predict: Callable[[StepShape], float], now: float = 0.0, *,
               draft: Callable[[StepShape], float] | None = None) -> list[int]:
        """Each row's k (0 .. its cap) for a pass whose rows so far have shape `base`, priced
        by `predict` (the module docstring's rule), each draft pass priced by `draft` (None:
        proposals cost no pass)."""
        ks = [0] * len(rows)
        time_s = predict(base)
        tokens = float(base.num_decode_rows)
        if time_s > 0 and tokens > 0:
            best = _Plan(ks, base, time_s, tokens, [])
            accs = [self.acceptance(row.request_id) for row in rows]
            empty_s = draft(StepShape()) if draft is not None else 0.0
            catch_ups = [_catch_up_s(row, draft, empty_s, expected_tokens(a, row.cap))
                         if draft is not None else 0.0 for row, a in zip(rows, accs)]
            candidates = _candidates(rows, accs)
            # A draft model runs one pass per proposal depth: each number of passes is a plan
            # of its own, its passes' fixed cost paid up front.
            max_cap = max((r.cap for r in rows), default=0)
            for depth in [max_cap] if draft is None else range(1, max_cap + 1):
                plan = self._plan(rows, base, predict, draft, depth, catch_ups, empty_s,
                                  [c for c in candidates if c[2] < depth])
                if plan.tokens * best.time_s > best.tokens * plan.time_s:
                    best = plan
            ks = best.ks
            self._probe(rows, ks, best, predict, draft)
            shape_s, tokens = best.time_s, best.tokens
        elif time_s <= 0:
            ks = [row.cap for row in rows]  # no cost to weigh: every proposal is free
            shape_s = time_s
        else:
            shape_s = time_s
        self._record(rows, ks, shape_s, tokens, now)
        return ks

    def _plan(self, rows: Sequence[SizingRow], base: StepShape,
              predict: Callable[[StepShape], float],
              draft: Callable[[StepShape], float] | None, depth: int,
              catch_ups: Sequence[float], empty_s: float,
              candidates: list[tuple[float, int, int]]) -> _Plan:
        """Proposals up to `depth` per row (`candidates`, in order of expected value), taken
        while each beats the rate so far (a row's first charged its share of the draft's
        catch-up); `empty_s`: an empty draft pass's cost."""
        shape = base
        shape_s = predict(shape)
        passes = [StepShape()] * depth if draft is not None else []
        time_s = shape_s + depth * empty_s
        tokens = float(base.num_decode_rows)
        ks = [0] * len(rows)
        for value, i, j in candidates:
            if ks[i] != j:
                continue  # the row's earlier proposal was not taken
            catch_up = catch_ups[i] if j == 0 else 0.0
            if _catch_up_blocks(value, time_s, tokens, 0.0, catch_up):
                continue  # the catch-up alone does not pay: no need to price the row
            grown = _one_more_query(shape)
            grown_s = predict(grown)
            added = grown_s - shape_s
            if draft is not None:
                grown_pass = _one_more_row(passes[j], rows[i].context)
                added += draft(grown_pass) - draft(passes[j])
            if _catch_up_blocks(value, time_s, tokens, added, catch_up):
                continue
            if value * time_s <= tokens * (added + catch_up):
                break  # value per added second no better than the rate
            ks[i] += 1
            tokens += value
            time_s += added + catch_up
            shape, shape_s = grown, grown_s
            if draft is not None:
                passes[j] = grown_pass
        return _Plan(ks, shape, time_s, tokens, passes)

    def _probe(self, rows: Sequence[SizingRow], ks: list[int], plan: _Plan,
               predict: Callable[[StepShape], float],
               draft: Callable[[StepShape], float] | None) -> None:
        """One proposal for each long-sized-off row whose proposals, all kept, would pay at
        some depth (module docstring)."""
        for i, row in enumerate(rows):
            s = self._seqs.get(row.request_id)
            if ks[i] or row.cap <= 0 or s is None or s.passes_off + 1 < PROBE_INTERVAL:
                continue
            certain, pays = _certain_pays(row, plan, predict, draft)
            if not certain:
                return  # not even certain tokens pay: no probe in this pass
            if pays:
                ks[i] = 1

    def _record(self, rows: Sequence[SizingRow], ks: list[int], time_s: float,
                tokens: float, now: float) -> None:
        """Counters for /metrics, a debug line per changed decision, an info summary."""
        off = 0
        summary = self._summary
        for row, k in zip(rows, ks):
            s = self._seqs.setdefault(row.request_id, SeqState())
            if k == 0:
                off += 1
                s.passes_off += 1
            else:
                s.passes_off = 0
                if s.k <= 0 and row.unseen > 1:  # a catch-up: not drafted the pass before
                    at = 4 if s.seen == 0 else 6
                    summary[at] += 1
                    summary[at + 1] += row.unseen - 1
            if k != s.k:
                logger.debug("speculation sizing: %s k %d -> %d (acceptance %.2f, pass %.2f "
                             "tokens in %.4f s)", row.request_id, max(s.k, 0), k,
                             self.acceptance(row.request_id), tokens, time_s)
                s.k = k
        proposals = sum(ks)
        self.num_sized_off += off
        self.last_num_rows, self.last_num_proposals = len(rows), proposals
        summary[0] += 1
        summary[1] += len(rows)
        summary[2] += proposals
        summary[3] += off
        if self._summary_since is None:
            self._summary_since = now
        elif now - self._summary_since >= SUMMARY_INTERVAL_S:
            logger.info("speculation sizing: %d passes, %d rows, mean k %.2f, %d sized off; "
                        "draft catch-ups: %d of whole prompts (%d tokens), %d resumed after "
                        "passes sized off (%d tokens); global acceptance %.2f", summary[0],
                        summary[1], summary[2] / max(summary[1], 1), *summary[3:],
                        self.global_acceptance)
            self._summary, self._summary_since = [0] * 8, now
