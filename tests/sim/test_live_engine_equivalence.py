"""The simulator and the live engine are the same scheduler: given the same arrivals and the same
per-pass latencies, the real `LLMEngine` (its step, output processor and listeners, over a
model-free executor) makes exactly the batches the simulator made, and its requests see the same
first-token and finish times."""

from __future__ import annotations

import pytest

from everystop.config import CacheConfig, EngineConfig, SchedulerConfig
from everystop.core.outputs import IterationRecord, ModelOutput, RequestOutput, SchedulerOutput
from everystop.core.request import Request
from everystop.engine.llm_engine import LLMEngine
from everystop.sampling_params import SamplingParams
from everystop.sim.simulator import SimResult, SimSetup, simulate
from everystop.workload import Workload, synthetic, synthetic_prompt_ids

from ..core.helpers import FakeClock
from ..core.toy_executor import ToyExecutor
from ..engine.toy_engine import CharTokenizer

# Poisson arrivals with three priority tiers, three tenants and a shared system prompt: the
# scheduler's admission order, aging, prefix-cache hits and preemption all come into play.
MIXED = ("n=48,prompt=uniform:20:200,output=uniform:5:60,rate=40,priority=0.3:0.4:0.3,"
         "prefix=0.4:48,tenants=3,seed=3")

Batch = tuple[list[tuple[str, int, int]], list[str]]


def _latency(shape):  # any deterministic function of the pass works
    return 0.004 + 2e-5 * shape.num_tokens + 1e-6 * shape.context_tokens_read


class ReplayExecutor:
    """The toy executor (which checks every block table against the tokens written), plus a
    clock that each pass advances by the latency the simulator gave the same pass."""

    def __init__(self, setup: SimSetup, clock: FakeClock, latencies: list[float]) -> None:
        self.toy = ToyExecutor(setup.num_gpu_blocks, setup.block_size, setup.num_cpu_blocks)
        self.num_gpu_blocks, self.num_cpu_blocks = setup.num_gpu_blocks, setup.num_cpu_blocks
        self.sliding_window = None
        self.clock, self.latencies = clock, latencies
        self.num_passes = 0

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        result = self.toy.execute(sched)
        # Past the simulator's last pass (a divergence the caller reports): any fixed latency.
        k = self.num_passes
        self.clock.now += self.latencies[k] if k < len(self.latencies) else 0.01
        self.num_passes += 1
        return result

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _live_engine(workload: Workload, setup: SimSetup, latencies: list[float]):
    """Run `workload` through a real LLMEngine, adding each request once the shared fake clock
    passes its arrival time; returns its batches, iteration records and final outputs."""
    clock = FakeClock()
    clock.now = 0.0
    config = EngineConfig(cache=CacheConfig(block_size=setup.block_size, watermark=setup.watermark,
                                            enable_prefix_caching=setup.enable_prefix_caching),
                          scheduler=setup.scheduler)
    executor = ReplayExecutor(setup, clock, latencies)
    engine = LLMEngine(config, executor, CharTokenizer(), cost_model=setup.preemption_cost,
                       clock=clock)
    batches: list[Batch] = []
    records: list[IterationRecord] = []

    def on_iteration(rec: IterationRecord, sched: SchedulerOutput) -> None:
        records.append(rec)
        batches.append(([(e.request_id, e.start_pos, e.num_tokens) for e in sched.scheduled],
                        list(sched.preempted_request_ids)))

    engine.iteration_listeners.append(on_iteration)
    finished: dict[str, RequestOutput] = {}
    pending = sorted(enumerate(workload.requests), key=lambda p: p[1].arrival_s)
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        while i < len(pending) and pending[i][1].arrival_s <= clock.now:
            k, spec = pending[i]
            engine.add_request(Request(
                spec.id, synthetic_prompt_ids(spec, k),
                SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True),
                arrival_time=spec.arrival_s, priority=spec.priority, tenant=spec.tenant))
            i += 1
        passes_before = executor.num_passes
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.scheduler.check_integrity()
        if executor.num_passes == passes_before:  # nothing could run: wait for the next arrival
            assert i < len(pending), "the engine is stuck with no arrival left to wait for"
            clock.now = max(clock.now + 1e-9, pending[i][1].arrival_s)
    return batches, records, finished


def _setup(chunked: bool, mode: str) -> SimSetup:
    # A small pool and host swap space force preemptions (swap in "auto", recompute otherwise).
    cfg = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=256, chunk_size=64,
                          enable_chunked_prefill=chunked, max_model_len=1024,
                          recompute_threshold_tokens=32, preemption_mode=mode)
    return SimSetup(cfg, num_gpu_blocks=80, num_cpu_blocks=40)


def _simulate(chunked: bool, mode: str) -> tuple[Workload, SimSetup, SimResult]:
    workload, setup = synthetic(MIXED), _setup(chunked, mode)
    return workload, setup, simulate(workload, setup, _latency, check=True)


@pytest.mark.parametrize("chunked,mode", [(True, "auto"), (False, "auto"),
                                          (True, "recompute"), (False, "recompute")])
def test_live_engine_makes_the_simulators_batches(chunked, mode):
    workload, setup, sim = _simulate(chunked, mode)
    assert sim.num_preemptions["swap" if mode == "auto" else "recompute"] > 0
    latencies = [it.latency_s for it in sim.iterations]
    batches, records, finished = _live_engine(workload, setup, latencies)

    sim_batches = [(it.scheduled, it.preempted) for it in sim.iterations]
    assert len(batches) == len(sim_batches)
    for step, (live, simulated) in enumerate(zip(batches, sim_batches)):
        assert live == simulated, f"pass {step} differs"
    # The shape the engine reports to its listeners (what calibration fits) is the shape the
    # simulator priced, and the measured latency is the one it charged.
    for rec, it in zip(records, sim.iterations):
        s = it.shape
        assert (rec.num_seqs, rec.num_decode_tokens, rec.num_prefill_tokens,
                rec.context_tokens) == (s.num_seqs, s.num_decode_tokens, s.num_prefill_tokens,
                                        s.context_tokens_read)
        assert rec.time == pytest.approx(it.start_s)
        assert rec.latency_s == pytest.approx(it.latency_s)
    # Same clock, same passes: every request's TTFT and finish time agree too.
    assert sorted(finished) == sorted(r.request_id for r in sim.requests)
    for req in sim.requests:
        out = finished[req.request_id]
        assert len(out.token_ids) == req.num_output_tokens == req.sampling_params.max_tokens
        assert out.metrics is not None
        assert out.metrics.first_token_time == pytest.approx(req.first_token_time)
        assert out.metrics.finished_time == pytest.approx(req.finished_time)


def test_chunking_changes_the_batches():
    # The comparison above is not vacuous: the two modes schedule differently.
    chunked = [it.scheduled for it in _simulate(True, "auto")[2].iterations]
    whole = [it.scheduled for it in _simulate(False, "auto")[2].iterations]
    assert chunked != whole
    assert max(n for b in chunked for _, _, n in b) <= 64 < max(n for b in whole for _, _, n in b)


def test_a_different_latency_breaks_the_equivalence():
    # The arrivals interleave with passes, so the clock matters: perturb one latency and the
    # live engine must diverge.
    workload, setup, sim = _simulate(True, "auto")
    latencies = [it.latency_s for it in sim.iterations]
    latencies[3] *= 5
    batches, _, _ = _live_engine(workload, setup, latencies)
    assert batches != [(it.scheduled, it.preempted) for it in sim.iterations]
