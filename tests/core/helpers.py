"""Builders shared by the scheduler tests: a scheduler over a toy executor and a fake clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from everystop.config import SchedulerConfig
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.outputs import RequestUpdate, SchedulerOutput
from everystop.core.request import Request
from everystop.core.scheduler import Scheduler
from everystop.core.step_cost import StepCostModel, StepShape
from everystop.sampling_params import SamplingParams, StructuredOutput

from .toy_executor import ToyExecutor


class FakeClock:
    def __init__(self) -> None:
        self.now = 1.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    scheduler: Scheduler
    executor: ToyExecutor
    clock: FakeClock
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    history: list[SchedulerOutput] = field(default_factory=list)

    def add(self, rid: str, prompt: list[int], max_tokens: int, priority: int = 1,
            tenant: str = "t", eos: int | None = None, seed: int | None = None,
            structured_output: StructuredOutput | None = None) -> Request:
        """`seed`: a sampled request (temperature 1) on that seed; else greedy.
        `structured_output`: marks the request so (the toy executor applies no grammar)."""
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens,
                                                        temperature=0 if seed is None else 1,
                                                        seed=seed, ignore_eos=eos is None,
                                                        structured_output=structured_output),
                      eos_token_id=eos, priority=priority, tenant=tenant)
        self.scheduler.add_request(req)
        self.outputs[rid] = []
        return req

    def step(self, dt: float = 0.01) -> tuple[SchedulerOutput, list[RequestUpdate]]:
        sched = self.scheduler.schedule()
        result = self.executor.execute(sched)
        updates = self.scheduler.update_from_output(sched, result)
        for u in updates:
            self.outputs[u.request_id].extend(u.new_token_ids)
            if u.finish_reason:
                self.finish[u.request_id] = u.finish_reason
        self.clock.now += result.execute_time_s or dt  # a timed executor sets the pace
        self.history.append(sched)
        self.scheduler.check_integrity()
        return sched, updates

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_unfinished:
            self.step()
            steps += 1
            if steps > max_steps:
                raise AssertionError("the engine made no progress (deadlock or livelock)")
        return steps


def check_swap_pairs(sched: SchedulerOutput, kv: KVCacheManager) -> None:
    """A pass's swaps copy only pool blocks (never the null block of a released window entry)
    to and from host blocks, each host block and each swap-in's device block once. A device
    block may be copied out twice: two sequences sharing a cached prefix block each keep a
    copy. NOTE: host and device ids are separate numberings (a host id may equal the null
    block's device id), so each side is checked on its own."""
    outs, ins = sched.blocks_to_swap_out, sched.blocks_to_swap_in
    null = kv.null_block
    for side in ([d for d, _ in outs], [d for _, d in ins]):  # device ids
        assert null is None or null.block_id not in side, side
        assert all(0 <= d < kv.num_gpu_blocks for d in side), side
    for side in ([h for _, h in outs], [h for h, _ in ins], [d for _, d in ins]):
        assert len(side) == len(set(side)), side
    for side in ([h for _, h in outs], [h for h, _ in ins]):  # host ids
        assert all(0 <= h < kv.num_cpu_blocks for h in side), side


def make_harness(num_blocks: int = 256, block_size: int = 4, num_cpu_blocks: int = 0,
                 prefix_caching: bool = True, watermark: float = 0.0,
                 sliding_window: int | None = None,
                 step_cost: StepCostModel | None = None,
                 cost_fn: Callable[[StepShape], float] | None = None,
                 **sched_kwargs: object) -> Harness:
    defaults: dict[str, object] = dict(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=16,
                                       max_model_len=4096)
    defaults.update(sched_kwargs)
    config = SchedulerConfig(**defaults)  # type: ignore[arg-type]
    kv = KVCacheManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                        enable_prefix_caching=prefix_caching, watermark=watermark,
                        sliding_window=sliding_window)
    clock = FakeClock()
    return Harness(Scheduler(config, kv, clock=clock, step_cost=step_cost),
                   ToyExecutor(num_blocks, block_size, num_cpu_blocks, cost_fn, sliding_window),
                   clock)
