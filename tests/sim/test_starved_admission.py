"""A small step budget must not make a KV-starved pool thrash.

With a TPOT target, prompts arrive in small chunks over many passes. Admitting a prompt whose
rest cannot fit the pool lets the running decodes' growth preempt it before it finishes, and it
is re-admitted, over and over: the benchmark's 24 requests on 40 blocks went from 13
preemptions (no target) to 80 on the real model and 273 here. The scheduler now starts a prompt
only if all of it fits above the watermark while others run."""

from __future__ import annotations

import pytest

from everystop.config import SchedulerConfig
from everystop.sim.simulator import SimSetup, simulate
from everystop.workload import Workload, WorkloadRequest

# A KV-starved workload's shape: prompts 96..288 tokens, outputs 48..112.
WORKLOAD = Workload("starved", 0, {}, [
    WorkloadRequest(id=str(i), prompt_len=96 + (i * 53) % 193, max_tokens=48 + (i * 29) % 65)
    for i in range(24)])


def _latency(shape) -> float:  # a pass: fixed cost plus prefill and decode tokens
    return 0.02 + 0.002 * shape.num_prefill_tokens + 0.0005 * shape.num_decode_tokens


def _preemptions(**options) -> int:
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024,
                          preemption_mode="recompute", **options)
    result = simulate(WORKLOAD, SimSetup(cfg, num_gpu_blocks=40, enable_prefix_caching=False),
                      _latency, check=True)
    assert len(result.requests) == 24 and all(r.is_finished for r in result.requests)
    return result.num_preemptions["recompute"]


@pytest.mark.parametrize("tpot_target_ms", [None, 50.0, 20.0])
def test_a_tpot_target_preempts_about_as_often_as_none(tpot_target_ms) -> None:
    untimed = _preemptions(tpot_target_ms=0.0)
    timed = _preemptions(tpot_target_ms=tpot_target_ms)
    print(f"\npreemptions: no target {untimed}, target {tpot_target_ms} ms {timed}")
    assert untimed > 0 and timed <= 2 * untimed
