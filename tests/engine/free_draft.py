"""A draft model priced as free, for tests of what drafted passes emit: the sizing rule
(core/spec_sizing.py, tested in tests/core/test_spec_sizing.py) rightly sizes off a draft that
costs what its target does (the default model drafting for itself, tiny models whose passes
cost their Python overhead), and a test of drafted tokens needs the drafts made."""

from __future__ import annotations

from everystop import LLM
from everystop.core.step_cost import StepCoefficients, StepCostModel, StepShape


class FreeDraftCost(StepCostModel):
    """Predicts 0 s for every draft pass and learns nothing from their times."""

    def __init__(self) -> None:
        super().__init__(StepCoefficients(0.0, 0.0, 0.0, 0.0))

    def predict(self, shape: StepShape) -> float:
        return 0.0

    def observe(self, shape: StepShape, seconds: float) -> None:
        pass


def free_draft(llm: LLM) -> LLM:
    """`llm` with its draft proposer's passes priced at nothing."""
    proposer = llm.engine.scheduler.proposer
    assert proposer is not None and hasattr(proposer, "pass_cost")
    proposer.pass_cost = FreeDraftCost()
    return llm
