"""An executor with no model: it samples a fixed token and advances a simulated clock by the
modeled latency of the pass it was handed.

It has the executor contract (`execute(SchedulerOutput) -> ModelOutput`), so anything that drives
a real executor - the simulator's loop here, or the engine's `LLMEngine.step` - can drive this one
and get a simulation. Requests must use ignore_eos (the token it returns is meaningless).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from everystop.core.outputs import ModelOutput, SchedulerOutput
from everystop.sim.cost_model import IterationShape
from everystop.sim.speculation import verify


class SimClock:
    """Simulated time in seconds; pass it as the Scheduler's `clock`."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError("time does not run backwards")
        self.now += dt


@dataclass
class IterationRecord:
    """One simulated forward pass (also the calibration record format, plus extra fields)."""

    start_s: float
    latency_s: float
    shape: IterationShape
    scheduled: list[tuple[str, int, int]]  # (request_id, start_pos, num_tokens)
    preempted: list[str]

    def to_dict(self) -> dict:
        return {"start_s": self.start_s, "latency_s": self.latency_s, **self.shape.to_dict()}


class SimExecutor:
    """`latency_fn` maps a pass's shape to seconds (normally `CostModel.latency`);
    `spec_acceptance`: each proposal's chance to be kept (sim/speculation.py), drawn from
    `seed`."""

    SAMPLED_TOKEN = 7  # any id works under ignore_eos

    def __init__(self, latency_fn: Callable[[IterationShape], float], clock: SimClock,
                 spec_acceptance: float = 0.0, seed: int = 0) -> None:
        self.latency_fn = latency_fn
        self.clock = clock
        self.records: list[IterationRecord] = []
        self.spec_acceptance = spec_acceptance
        self._rng = random.Random(seed)

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        shape = IterationShape.from_scheduler_output(sched)
        latency = self.latency_fn(shape)
        self.records.append(IterationRecord(
            start_s=self.clock.now, latency_s=latency, shape=shape,
            scheduled=[(e.request_id, e.start_pos, e.num_tokens) for e in sched.scheduled],
            preempted=list(sched.preempted_request_ids)))
        self.clock.advance(latency)
        verified = (verify(sched, self.spec_acceptance, self._rng) if sched.num_draft_tokens
                    else {})
        return ModelOutput(sampled_token_ids={e.request_id: self.SAMPLED_TOKEN
                                              for e in sched.scheduled if e.sample},
                           verified_token_ids=verified, execute_time_s=latency)
