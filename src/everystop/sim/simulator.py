"""Discrete-event simulation of the real Scheduler and KVCacheManager.

Time only moves in two ways: a forward pass takes its modeled latency (the SimExecutor advances
the clock), or, when nothing can run, the clock jumps to the next event (an arrival, or the
static-batching timeout). Everything else - admission, chunking, preemption, prefix caching - is
the production scheduler's own code, so what the simulator shows is what the server would do.

The step itself is `engine.step()`: by default a `SchedulerEngine` doing exactly what the live
engine does (schedule -> execute -> update_from_output). Any object with `add_request`, `step`
and a `scheduler` attribute (the engine's LLMEngine built over a SimExecutor and a SimClock) can
be plugged in through `engine_factory`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from everystop.config import SchedulerConfig
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.outputs import RequestUpdate
from everystop.core.preemption import PreemptionCostModel
from everystop.core.request import Request
from everystop.core.scheduler import QueueFull, RequestRejected, Scheduler
from everystop.sampling_params import SamplingParams
from everystop.sim.cost_model import IterationShape
from everystop.sim.sim_executor import IterationRecord, SimClock, SimExecutor
from everystop.sim.speculation import SimProposer
from everystop.workload import Workload, synthetic_prompt_ids


class StepEngine(Protocol):
    scheduler: Scheduler

    def add_request(self, req: Request) -> None: ...

    def step(self) -> list[RequestUpdate]: ...


class SchedulerEngine:
    """The engine's step with nothing else: schedule, execute, update."""

    def __init__(self, scheduler: Scheduler, executor: SimExecutor) -> None:
        self.scheduler, self.executor = scheduler, executor

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def step(self) -> list[RequestUpdate]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []  # nothing to run: no pass, no time spent
        return self.scheduler.update_from_output(out, self.executor.execute(out))


@dataclass
class Occupancy:
    """State right after one pass."""

    time_s: float
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float


@dataclass
class SimResult:
    requests: list[Request]
    rejected: dict[str, str]
    iterations: list[IterationRecord]
    occupancy: list[Occupancy]
    num_preemptions: dict[str, int]
    end_time_s: float
    config: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SimSetup:
    """Everything about the simulated node except the workload."""

    scheduler: SchedulerConfig
    num_gpu_blocks: int
    block_size: int = 16
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    watermark: float = 0.02
    preemption_cost: PreemptionCostModel = field(default_factory=PreemptionCostModel)
    # Speculative decoding: each proposal's chance to be kept (sim/speculation.py); None: off.
    # The scheduler config names the method and k.
    spec_acceptance: float | None = None

    def __post_init__(self) -> None:
        a = self.spec_acceptance
        if a is not None and (not 0.0 <= a <= 1.0 or self.scheduler.speculative == "off"):
            raise ValueError(f"spec_acceptance must be in [0, 1] with speculation on, not {a!r}"
                             f" (speculative={self.scheduler.speculative!r})")


EngineFactory = Callable[[Scheduler, SimExecutor], StepEngine]


def simulate(workload: Workload, setup: SimSetup,
             latency_fn: Callable[[IterationShape], float], *,
             engine_factory: EngineFactory = SchedulerEngine, check: bool = False,
             max_iterations: int = 5_000_000) -> SimResult:
    """Run `workload` through the real scheduler with modeled pass latencies."""
    clock = SimClock(0.0)
    executor = SimExecutor(latency_fn, clock, setup.spec_acceptance or 0.0)
    kv = KVCacheManager(setup.num_gpu_blocks, setup.block_size,
                        num_cpu_blocks=setup.num_cpu_blocks,
                        enable_prefix_caching=setup.enable_prefix_caching,
                        watermark=setup.watermark)
    sched = Scheduler(setup.scheduler, kv, cost_model=setup.preemption_cost, clock=clock)
    if setup.spec_acceptance is not None:
        sched.proposer = SimProposer()
    engine = engine_factory(sched, executor)
    arrivals = [r.arrival_s or 0.0 for r in workload.requests]  # None: at t=0
    order = sorted(range(len(workload.requests)), key=arrivals.__getitem__)
    pending = [(workload.requests[k], k) for k in order]
    requests: list[Request] = []
    rejected: dict[str, str] = {}
    occupancy: list[Occupancy] = []
    i = 0
    while i < len(pending) or sched.has_unfinished:
        while i < len(pending) and arrivals[pending[i][1]] <= clock.now:
            spec, index = pending[i]
            req = Request(spec.id, synthetic_prompt_ids(spec, index),
                          SamplingParams(max_tokens=spec.max_tokens, temperature=0.0,
                                         ignore_eos=True),
                          arrival_time=arrivals[index], priority=spec.priority, tenant=spec.tenant)
            try:
                engine.add_request(req)
                requests.append(req)
            except (RequestRejected, QueueFull) as exc:
                rejected[spec.id] = str(exc)
            i += 1
        if not sched.has_unfinished:
            if i < len(pending):
                clock.now = max(clock.now, arrivals[pending[i][1]])
            continue
        ran_before = len(executor.records)
        engine.step()
        if check:
            sched.check_integrity()
        if len(executor.records) > max_iterations:
            raise RuntimeError("simulation exceeded max_iterations")
        if len(executor.records) > ran_before:
            occupancy.append(Occupancy(clock.now, len(sched.running),
                                       len(sched.waiting) + len(sched.preempted),
                                       len(sched.swapped), kv.pool.usage()))
            continue
        clock.now = _next_event(sched, arrivals[pending[i][1]] if i < len(pending) else None,
                                clock.now)
    return SimResult(requests=requests, rejected=rejected, iterations=executor.records,
                     occupancy=occupancy, num_preemptions=dict(sched.num_preemptions),
                     end_time_s=clock.now)


def _next_event(sched: Scheduler, next_arrival: float | None, now: float) -> float:
    """When nothing could run: the next time something can change."""
    times = [] if next_arrival is None else [next_arrival]
    cfg = sched.config
    if cfg.scheduling == "static":
        queued = [r.arrival_time for q in (sched.waiting, sched.preempted) for r in q]
        if queued:
            times.append(min(queued) + cfg.static_batch_timeout_s + 1e-9)
    if not times:
        raise RuntimeError("the scheduler cannot run anything and no event is pending "
                           "(a request larger than the KV pool?)")
    return max(now + 1e-9, min(times))
