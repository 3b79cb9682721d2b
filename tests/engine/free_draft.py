"""A draft model priced as free and every proposal taken, for tests of what drafted passes
emit: the sizing rule (core/spec_sizing.py, tested in tests/core/test_spec_sizing.py) rightly
sizes off a draft that costs what its target does (the default model drafting for itself, tiny
models whose passes cost their Python overhead), and a test of drafted tokens needs the drafts
made."""

from __future__ import annotations

from collections.abc import Sequence

from everystop import LLM
from everystop.core.arrival_rate import ArrivalRate
from everystop.core.spec_sizing import SizingRow, SpecSizer
from everystop.core.step_cost import StepCoefficients, StepCostModel, StepShape


class FreeDraftCost(StepCostModel):
    """Predicts 0 s for every draft pass and learns nothing from their times."""

    def __init__(self) -> None:
        super().__init__(StepCoefficients(0.0, 0.0, 0.0, 0.0))

    def predict(self, shape: StepShape) -> float:
        return 0.0

    def observe(self, shape: StepShape, seconds: float) -> None:
        pass


class EveryProposal(SpecSizer):
    """Sizes every row to its cap. The rule prices the target's verified rows by measured
    time, so on a loaded host, or once a tiny random draft's acceptance is measured low, it
    may size every row off and leave a test of drafted tokens with none."""

    def choose(self, rows: Sequence[SizingRow], *args: object, **kwargs: object) -> list[int]:
        ks = [row.cap for row in rows]
        self._record(rows, ks, 0.0, float(len(rows)), 0.0)
        return ks


class NoArrivalsExpected(ArrivalRate):
    """Expects no arrival in any pass: a burst of test prompts, at a pass time that follows the
    host's load, would otherwise yield a timing-dependent share of passes (core/spec_room.py,
    tested in tests/core/test_spec_room.py)."""

    def expected(self, now: float, span_s: float) -> float:
        return 0.0


def free_draft(llm: LLM) -> LLM:
    """`llm` with its draft proposer's passes priced at nothing, every row sized to as many
    proposals as it may take and no pass yielded to expected arrivals: what the drafts emit
    does not hang on timings."""
    sched = llm.engine.scheduler
    proposer = sched.proposer
    assert proposer is not None and hasattr(proposer, "pass_cost")
    proposer.pass_cost = FreeDraftCost()
    sched.spec_sizer = EveryProposal()
    sched.arrivals = NoArrivalsExpected()
    return llm
