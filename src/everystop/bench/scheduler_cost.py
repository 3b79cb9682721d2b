"""Scheduler cost per iteration, and the engine's decode throughput by batch size.

    everystop bench scheduler [--no-model] \
        [--out benchmarks/results/scheduler_bench.json]

Part 1 (no model): 128 running sequences and 1,000 waiting, block size 16, prefix caching on;
times schedule() + update_from_output() with a no-op executor. Goal: median under 1 ms.
Part 2 (default model): steady-state decode steps with 1, 32 and 128 running sequences.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from typing import Any

from everystop.config import SchedulerConfig
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.outputs import ModelOutput
from everystop.core.request import Request
from everystop.core.scheduler import Scheduler
from everystop.results import write_result
from everystop.sampling_params import SamplingParams
from everystop.stats import percentile


def bench_scheduler(num_running: int = 128, num_waiting: int = 1000,
                    steps: int = 400) -> dict[str, Any]:
    config = SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=2048,
                             max_model_len=4096)
    kv = KVCacheManager(100_000, 16, enable_prefix_caching=True)
    sched = Scheduler(config, kv)
    params = SamplingParams(max_tokens=3000, ignore_eos=True)
    for i in range(num_running + num_waiting):
        prompt = [(i * 7 + j) % 30000 for j in range(200 + i % 300)]
        sched.add_request(Request(f"r{i}", prompt, params))
    # Let the first 128 finish their prefill so the steady state is all decodes + a full queue.
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running) or \
            len(sched.running) < num_running:
        out = sched.schedule()
        sched.update_from_output(out, ModelOutput(
            {e.request_id: 5 for e in out.scheduled if e.sample}))
    times_schedule, times_update = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        result = ModelOutput({e.request_id: 5 for e in out.scheduled if e.sample})
        t2 = time.perf_counter()
        sched.update_from_output(out, result)
        t3 = time.perf_counter()
        times_schedule.append(t1 - t0)
        times_update.append(t3 - t2)
    total = [a + b for a, b in zip(times_schedule, times_update)]
    return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
            "steps": steps,
            "schedule_ms_median": statistics.median(times_schedule) * 1e3,
            "update_ms_median": statistics.median(times_update) * 1e3,
            "total_ms_median": statistics.median(total) * 1e3,
            "total_ms_p99": percentile(total, 99, empty=math.nan) * 1e3,
            "goal_ms": 1.0}


def bench_decode(batch_sizes: tuple[int, ...] = (1, 32, 128), steps: int = 12,
                 dtype: str = "float32") -> list[dict[str, Any]]:
    from everystop import LLM

    llm = LLM(max_num_seqs=max(batch_sizes), max_num_batched_tokens=4096, dtype=dtype)
    engine = llm.engine
    results = []
    for bs in batch_sizes:
        params = SamplingParams(max_tokens=steps + 50, ignore_eos=True, temperature=0.0)
        reqs = [engine.add_request([(i * 13 + j) % 40000 + 10 for j in range(64)], params)
                for i in range(bs)]
        while any(r.num_output_tokens == 0 for r in reqs):  # finish all prefills first
            engine.step()
        lat = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            lat.append(time.perf_counter() - t0)
        med = statistics.median(lat)
        results.append({"batch": bs, "dtype": dtype, "step_ms_median": med * 1e3,
                        "decode_tokens_per_s": bs / med})
        engine.abort_request([r.request_id for r in reqs])
        engine.step()
    return results


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="benchmarks/results/scheduler_bench.json")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--dtype", default="float32")


def run(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                    "scheduler": bench_scheduler()}
    print(json.dumps(result["scheduler"], indent=2))
    if not args.no_model:
        result["decode"] = bench_decode(dtype=args.dtype)
        print(json.dumps(result["decode"], indent=2))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_result(result, args.out, quiet=True)
    return 0
