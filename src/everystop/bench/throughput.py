"""Offline throughput of the engine on the 128-request mixed workload (all requests at t=0),
plus the single-stream decode latency; writes JSON.

    everystop bench throughput --dtype bfloat16 --out benchmarks/results/throughput_bf16.json
    everystop bench throughput --mode single --dtype float32

Modes: `workload` (the mixed workload; output tok/s, TTFT percentiles), `single` (one request,
128-token prompt, 128 new tokens; ms per decoded token). Each timed run follows a short warm-up.
With `--peaks` (a roofline JSON), the result's place under this machine's roofline is recorded.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import replace
from typing import Any

from everystop.results import write_result
from everystop.stats import percentile
from everystop.workload import Workload


def add_engine_arguments(ap: argparse.ArgumentParser) -> None:
    """The engine flags the in-process measurements (throughput, profile) share."""
    ap.add_argument("--model", default=None,
                    help="GGUF file or Hugging Face directory (default: the bundled model)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-kernels", default="auto", help="kernel build (auto, avx2, ...)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default="auto",
                    help="how weights are held (auto keeps the default model's Q4_1 blocks; "
                    "none: --dtype throughout; bf16: 16-bit weights, --dtype activations)")
    ap.add_argument("--int8-decode-dot", default="auto", choices=("auto", "on", "off"),
                    help="block weights meet int8-rounded activations (auto: where they can)")
    ap.add_argument("--cpu-16bit-gemm", default="auto", choices=("auto", "fp32", "native"),
                    help="compute-bound GEMMs on 16-bit weights and block-weight tiles: fp32 "
                    "or bf16 (auto: as the engine picks)")
    ap.add_argument("--kv-cache-gib", type=float, default=3.0,
                    help="KV pool size: the whole 128-request workload (~47k tokens) fits in "
                    "3 GiB at fp32")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="a row computes the same whatever shares its pass (see serve --help)")


def engine_options(args: argparse.Namespace, **more: Any) -> dict[str, Any]:
    """LLM(...) options from add_engine_arguments' flags, plus `more`."""
    options: dict[str, Any] = {"model": args.model, "dtype": args.dtype,
                               "cpu_kernels": args.cpu_kernels,
                               "kv_cache_dtype": args.kv_cache_dtype,
                               "quantization": args.quantization,
                               "int8_decode_dot": args.int8_decode_dot,
                               "cpu_16bit_gemm": args.cpu_16bit_gemm,
                               "batch_invariant": args.batch_invariant,
                               "kv_cache_memory": int(args.kv_cache_gib * (1 << 30)), **more}
    if args.threads is not None:
        options["num_threads"] = args.threads
    return options


def build_llm(args: argparse.Namespace) -> tuple[Any, float]:
    from everystop import LLM

    start = time.perf_counter()
    llm = LLM(**engine_options(args, max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=args.max_num_batched_tokens))
    return llm, time.perf_counter() - start


def run_workload(llm: Any, workload: Workload, temperature: float) -> dict[str, Any]:
    """Every request at t=0 through the engine's own loop (bench.offline.run_engine): output
    and total tok/s, steps, TTFT percentiles."""
    from everystop.bench.offline import run_engine

    engine = llm.engine
    steps0 = engine.num_steps
    run = run_engine(engine, workload, temperature=temperature)
    n_out = sum(r.output_tokens for r in run.results)
    n_prompt = sum(r.prompt_len for r in run.results)
    ttft = [r.ttft_s for r in run.results if r.output_tokens]
    return {"elapsed_s": run.duration_s, "num_requests": len(run.results),
            "prompt_tokens": n_prompt, "output_tokens": n_out,
            "output_tok_s": n_out / run.duration_s,
            "total_tok_s": (n_out + n_prompt) / run.duration_s,
            "num_steps": engine.num_steps - steps0,
            "ttft_p50_s": percentile(ttft, 50, empty=math.nan),
            "ttft_p99_s": percentile(ttft, 99, empty=math.nan)}


def warm_up_workload(workload: Workload, n: int = 8, max_tokens: int = 4) -> Workload:
    """The first `n` requests cut to `max_tokens`: a short run before the timed ones, so
    one-time costs stay out of the numbers."""
    return Workload(f"{workload.name}-warm-up", workload.seed, workload.spec,
                    [replace(r, max_tokens=max_tokens) for r in workload.requests[:n]])


def run_single(llm: Any, prompt_len: int = 128, new_tokens: int = 128) -> dict[str, Any]:
    """One request alone: TTFT, then ms per decoded token (timed through the engine's steps)."""
    from everystop import SamplingParams
    from everystop.workload import english_corpus

    tok = llm.get_tokenizer()
    prompt = tok.encode(english_corpus(collapse_whitespace=False)[:4000])[:prompt_len]
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                              ignore_eos=True))
    step_times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    decode = step_times[1:]  # step 0 is the prefill (and samples the first token)
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "ttft_s": step_times[0],
            "decode_ms_per_token_mean": 1000 * sum(decode) / len(decode),
            "decode_ms_per_token_median": 1000 * percentile(decode, 50, empty=math.nan),
            "decode_ms_per_token_min": 1000 * min(decode)}


def load_perf_workload(args: argparse.Namespace) -> Workload:
    """`--workload` (a workload JSON), else the committed perf-mixed-128 cut to
    `--num-requests`."""
    from everystop.workload import load_workload, perf_workload

    return load_workload(args.workload) if args.workload else perf_workload(args.num_requests)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mode", choices=("workload", "single"), default="workload")
    add_engine_arguments(ap)
    ap.add_argument("--workload", help="workload JSON (default: the committed perf-mixed-128)")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs (min is reported)")
    ap.add_argument("--peaks", help="a roofline JSON (everystop bench roofline): place the "
                    "result under it")
    ap.add_argument("--out", help="JSON file to write")


def run(args: argparse.Namespace) -> int:
    llm, startup_s = build_llm(args)
    import torch

    result: dict[str, Any] = {
        "bench": f"throughput-{args.mode}", "dtype": args.dtype, "startup_s": startup_s,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpus": len(os.sched_getaffinity(0)), "load_avg_before": os.getloadavg()}
    if args.mode == "single":
        run_single(llm, 32, 8)  # warm-up
        runs = [run_single(llm) for _ in range(args.repeats)]
        result["runs"] = runs
        result.update(min(runs, key=lambda r: r["decode_ms_per_token_mean"]))
    else:
        workload = load_perf_workload(args)
        run_workload(llm, warm_up_workload(workload), args.temperature)
        runs = [run_workload(llm, workload, args.temperature) for _ in range(args.repeats)]
        result["runs"] = runs
        result["workload"] = {"name": workload.name, "seed": workload.seed}
        result.update(max(runs, key=lambda r: r["output_tok_s"]))
    result["load_avg_after"] = os.getloadavg()
    roofline = None
    if args.peaks:
        from everystop.bench.roofline import annotate, load_peaks
        roofline = annotate(result, load_peaks(args.peaks))
    write_result(result, args.out, roofline=roofline)
    return 0
