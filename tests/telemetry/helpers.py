"""A toy engine (no model) on a clock the test moves, for deterministic telemetry."""

from __future__ import annotations

import time
from typing import Any

from everystop.config import CacheConfig, EngineConfig, SchedulerConfig
from everystop.engine.llm_engine import LLMEngine
from everystop.sampling_params import SamplingParams
from tests.core.helpers import FakeClock
from tests.core.toy_executor import ToyExecutor
from tests.engine.toy_engine import CharTokenizer


def make_engine(clock: Any = None, num_blocks: int = 256, block_size: int = 4,
                executor: Any = None, **sched: object) -> LLMEngine:
    defaults: dict[str, object] = dict(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=16,
                                       max_model_len=4096)
    defaults.update(sched)
    config = EngineConfig(cache=CacheConfig(block_size=block_size, watermark=0.0),
                          scheduler=SchedulerConfig(**defaults))  # type: ignore[arg-type]
    return LLMEngine(config, executor or ToyExecutor(num_blocks, block_size), CharTokenizer(),
                     clock=clock or time.monotonic)


def run(eng: LLMEngine, clock: FakeClock | None = None, dt: float = 0.01) -> dict[str, list[int]]:
    """Step to completion (advancing a fake clock dt per step); the tokens each request got."""
    got: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        eng.scheduler.check_integrity()
        if clock is not None:
            clock.now += dt
    return got


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


class SlowExecutor:
    """The toy executor with a pause per forward pass, so a test can act mid-run."""

    def __init__(self, inner: ToyExecutor, pause_s: float) -> None:
        self.inner, self.pause_s = inner, pause_s
        self.num_gpu_blocks, self.num_cpu_blocks = inner.num_gpu_blocks, inner.num_cpu_blocks
        self.sliding_window = inner.sliding_window

    def execute(self, sched: Any) -> Any:
        time.sleep(self.pause_s)
        return self.inner.execute(sched)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
