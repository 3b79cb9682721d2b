"""What one engine step costs here by its shape: `everystop bench step-floor`, writes JSON.

A TPOT target below the cost of a pure-decode step of the batch it must carry cannot be
honoured by any prefill budget: the step is over before prefill gets a token. This measures
that floor. Requests with a `--prompt-len` prompt join one by one (each joining step is timed
as a mixed step: the batch's decodes plus that prompt's chunk) until the batch holds B decoding
sequences; then `--steps` pure-decode steps are timed, for each B in `--batch-sizes`. Each
step is timed two ways: the forward pass alone (what the step-cost model is fitted to) and the
whole iteration (schedule + forward + applying the results: what a client sees between tokens,
short of the HTTP stream).

    everystop bench step-floor --dtype bfloat16 --out benchmarks/results/step_floor.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from everystop.bench.throughput import add_engine_arguments, engine_options
from everystop.results import write_result


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_engine_arguments(ap)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,24,32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8, help="pure-decode steps timed per batch size")
    ap.add_argument("--out", default="benchmarks/results/step_floor.json")


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"min": round(ordered[0], 2), "median": round(statistics.median(ordered), 2),
            "max": round(ordered[-1], 2)}


def run(args: argparse.Namespace) -> int:
    from everystop import LLM, SamplingParams
    from everystop.workload import perf_workload

    sizes = sorted({int(x) for x in args.batch_sizes.split(",") if x})
    # The target off and one chunk per prompt: every joining step carries a whole prompt.
    llm = LLM(**engine_options(args, max_num_seqs=max(sizes), tpot_target_ms=0.0,
                               chunk_size=args.prompt_len,
                               max_num_batched_tokens=max(2048, args.prompt_len + max(sizes))))
    engine = llm.engine
    encode = engine.tokenizer.encode
    prompts = [ids for r in perf_workload().requests
               if len(ids := r.prompt_token_ids or encode(r.prompt)) >= args.prompt_len]
    if not prompts:
        raise SystemExit(f"no workload prompt has {args.prompt_len} tokens")

    def timed_step() -> dict[str, Any]:
        t0 = time.perf_counter()
        sched = engine.scheduler.schedule()
        result = engine.executor.execute(sched)
        engine.finish_step(sched, result, t0)
        return {"decodes": sched.num_decode_tokens, "prefill": sched.num_prefill_tokens,
                "context": sum(e.seq_len for e in sched.scheduled),
                "execute_ms": 1e3 * result.execute_time_s,
                "iteration_ms": 1e3 * (time.perf_counter() - t0)}

    params = SamplingParams(max_tokens=engine.max_model_len - args.prompt_len, temperature=0.0,
                            ignore_eos=True)
    mixed: list[dict[str, Any]] = []
    decode: list[dict[str, Any]] = []
    joined = 0
    for size in sizes:
        while joined < size:
            prompt = list(prompts[joined % len(prompts)][:args.prompt_len])
            engine.add_request(prompt, params)
            joined += 1
            mixed.append(timed_step())
        rows = [timed_step() for _ in range(args.steps)]
        assert all(r["prefill"] == 0 and r["decodes"] == size for r in rows), rows
        decode.append({"batch": size, "context_mean": round(
                           statistics.mean(r["context"] for r in rows) / size),
                       "execute_ms": _percentiles([r["execute_ms"] for r in rows]),
                       "iteration_ms": _percentiles([r["iteration_ms"] for r in rows])})
        print(f"batch {size:>3}: decode step execute {decode[-1]['execute_ms']['median']:.1f} "
              f"ms, iteration {decode[-1]['iteration_ms']['median']:.1f} ms", flush=True)
    out = {"dtype": args.dtype, "prompt_len": args.prompt_len,
           "load_avg_after": [round(x, 2) for x in os.getloadavg()],
           "pure_decode_steps": decode,
           "mixed_steps": [{k: round(v, 2) if isinstance(v, float) else v
                            for k, v in r.items()} for r in mixed]}
    write_result(out, args.out)
    return 0
