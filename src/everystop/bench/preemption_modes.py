"""Throughput and TTFT under a KV-starved workload: recompute-only vs swap-only vs cost model.

    everystop bench preemption [--requests 48] [--blocks 48] [--rounds 2]
        [--out benchmarks/results/preemption_bench.json]

All requests arrive at t=0 into a KV pool far smaller than they need together, so the engine
must preempt. The three modes run in alternating order for --rounds rounds in one process (the
machine is shared and noisy: compare the ratios within a round). Outputs are checked equal
across modes (greedy), so a faster mode cannot be faster by being wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from typing import Any

from everystop.results import write_result
from everystop.sampling_params import SamplingParams
from everystop.stats import percentile

MODES = ("recompute", "swap", "auto")


def workload(n: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens): prompts 96..288 tokens, outputs 48..112."""
    out = []
    for i in range(n):
        plen = 96 + (i * 53) % 193
        out.append(([(i * 31 + j * 7) % 40000 + 100 for j in range(plen)], 48 + (i * 29) % 65))
    return out


def run_mode(mode: str, reqs: list[tuple[list[int], int]], blocks: int,
             dtype: str) -> dict[str, Any]:
    from everystop import LLM

    llm = LLM(max_num_seqs=64, max_num_batched_tokens=1024, block_size=16,
              num_gpu_blocks_override=blocks, swap_space_gib=0.5, preemption_mode=mode,
              enable_prefix_caching=False, dtype=dtype)
    eng = llm.engine
    start = time.monotonic()
    ids = [eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  ignore_eos=True),
                           arrival_time=start).request_id for prompt, max_tokens in reqs]
    finals = {}
    eng.run_until_done(lambda o: finals.__setitem__(o.request_id, o) if o.finished else None)
    wall = time.monotonic() - start
    outs = list(finals.values())
    ttft = sorted(o.metrics.ttft_s for o in outs)
    sched = eng.scheduler
    bytes_per_block = eng.executor.runner.bytes_per_block
    return {
        "mode": mode, "wall_s": wall,
        "output_tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
        "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": percentile(ttft, 99),
        "preemptions_recompute": sched.num_preemptions["recompute"],
        "preemptions_swap": sched.num_preemptions["swap"],
        "swap_out_bytes": sched.num_swap_out_blocks * bytes_per_block,
        "swap_in_bytes": sched.num_swap_in_blocks * bytes_per_block,
        "max_preemptions_one_request": max(o.metrics.preemption_count for o in outs),
        "cost_model": dataclasses.asdict(sched.cost_model),
        "tokens": [finals[rid].token_ids for rid in ids],  # in submission order
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="benchmarks/results/preemption_bench.json")


def run(args: argparse.Namespace) -> int:
    reqs = workload(args.requests)
    rounds = []
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        results = {m: run_mode(m, reqs, args.blocks, args.dtype) for m in order}
        reference = results["recompute"].pop("tokens")
        for m in ("swap", "auto"):
            assert results[m].pop("tokens") == reference, f"{m} changed the greedy outputs"
        rounds.append(results)
        for m in MODES:
            x = results[m]
            print(f"round {r} {m:9s} {x['output_tokens_per_s']:7.1f} tok/s  "
                  f"TTFT p99 {x['ttft_p99_s']:6.2f}s  preempt r/s "
                  f"{x['preemptions_recompute']}/{x['preemptions_swap']}")
    summary = {m: {"output_tokens_per_s_median": statistics.median(
        rd[m]["output_tokens_per_s"] for rd in rounds), "ttft_p99_s_median": statistics.median(
        rd[m]["ttft_p99_s"] for rd in rounds)} for m in MODES}
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "workload": {"requests": args.requests, "kv_blocks": args.blocks,
                           "block_size": 16,
                           "prompt_tokens": sum(len(p) for p, _ in reqs),
                           "output_tokens": sum(m for _, m in reqs)},
              "outputs_equal_across_modes": True, "rounds": rounds, "summary": summary}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_result(result, args.out, quiet=True)
    print(json.dumps(summary, indent=2))
    return 0
