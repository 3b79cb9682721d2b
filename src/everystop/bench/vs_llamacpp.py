"""Head to head with llama.cpp's server on the 128-request mixed workload (all at t=0, the same
token ids, ignore_eos, greedy), in one run: output tok/s and TTFT percentiles of each; JSON out.

    everystop bench vs-llamacpp --llama-server /path/to/llama-server \\
        --gguf /tmp/smollm2-f16.gguf --dtype bfloat16 --out benchmarks/results/vs_llamacpp.json

llama.cpp is not built here: pass the binary (built outside this tree). Its server runs on
127.0.0.1 in its default KV configuration (one cache per slot, each sized for the longest
request; `--slots N`, default 32, the rest queue) and is driven by an asyncio streaming client;
its exact command line is recorded. everystop runs the same requests through its offline API
(LLM.generate) in its own best configuration (`--everystop-max-num-seqs`, default 128).

Another model (e.g. the 1B-shape GGUFs of scripts/make_llama1b_gguf.py, the same file for both
engines): `--model FILE --quantization auto`, and `--length-scale F` to scale every prompt and
output length of the workload by F (a bigger model's run kept to minutes). Each engine's peak
resident memory (VmHWM) is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import time
from dataclasses import replace
from typing import Any

from everystop.bench.client import sse_data
from everystop.results import write_result
from everystop.stats import percentile
from everystop.workload import Workload


def scale_lengths(workload: Workload, factor: float) -> Workload:
    """Every prompt cut to its first ceil(factor x length) token ids and every output budget
    scaled by `factor` (at least one token each): the workload's mix, at another size."""
    if factor == 1.0:
        return workload
    if not 0.0 < factor <= 1.0:
        raise SystemExit(f"--length-scale must be in (0, 1], got {factor}")
    reqs = []
    for r in workload.requests:
        n = max(1, math.ceil(r.prompt_len * factor))
        ids = r.prompt_token_ids[:n] if r.prompt_token_ids is not None else None
        reqs.append(replace(r, prompt_len=n, prompt_token_ids=ids,
                            max_tokens=max(1, round(r.max_tokens * factor))))
    return Workload(f"{workload.name}x{factor:g}", workload.seed, workload.spec, reqs)


def _version(binary: str) -> str:
    proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    return (proc.stdout + proc.stderr).strip()


async def _one(client: Any, url: str, req: dict[str, Any], t0: float) -> dict[str, Any]:
    body = {"prompt": req["prompt_token_ids"], "n_predict": req["max_tokens"],
            "ignore_eos": True, "temperature": 0.0, "stream": True, "cache_prompt": False}
    first = None
    n_events = 0
    predicted = None
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for data in sse_data(resp):
            event = json.loads(data)
            if first is None:
                first = time.perf_counter() - t0
            n_events += 1
            if event.get("stop"):
                predicted = event.get("timings", {}).get("predicted_n")
    return {"ttft_s": first, "end_s": time.perf_counter() - t0,
            "tokens": predicted if predicted is not None else n_events}


async def _drive(base_url: str,
                 reqs: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    import httpx

    url = f"{base_url}/completion"
    limits = httpx.Limits(max_connections=len(reqs) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await _one(client, url, dict(reqs[0], max_tokens=4), time.perf_counter())  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, r, t0) for r in reqs))
        return time.perf_counter() - t0, results


def run_llamacpp(args: argparse.Namespace, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    from everystop.bench.servers import llama_server, process_memory

    # Per-slot caches split -c evenly: each slot must hold the longest request.
    longest = max(r["prompt_len"] + r["max_tokens"] for r in reqs) + 64
    flags = ["-np", str(args.slots), "-c", str(args.slots * longest), "-t", str(args.threads),
             "-tb", str(args.threads), "-b", str(args.batch), "-ub", str(args.ubatch),
             *args.extra.split()]
    with llama_server(args.llama_server, args.gguf, flags, port=args.port,
                      log_path=args.server_log) as server:
        elapsed, results = asyncio.run(_drive(server.url, reqs))
        memory = process_memory(server.proc.pid)
    n_out = sum(r["tokens"] for r in results)
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    return {"engine": "llama.cpp server", "version": _version(args.llama_server),
            "command": server.command, "gguf": args.gguf, "elapsed_s": elapsed,
            "output_tokens": n_out, "output_tok_s": n_out / elapsed,
            "ttft_p50_s": percentile(ttft, 50, empty=math.nan),
            "ttft_p99_s": percentile(ttft, 99, empty=math.nan),
            "rss_end_bytes": memory["rss_bytes"], "peak_rss_bytes": memory["peak_rss_bytes"]}


def run_everystop(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    from everystop import LLM
    from everystop.bench.servers import process_memory
    from everystop.bench.throughput import run_workload, warm_up_workload

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.everystop_max_num_seqs,
              kv_cache_memory=int(args.kv_cache_gib * (1 << 30)), cpu_kernels=args.cpu_kernels,
              tpot_target_ms=args.tpot_target_ms, quantization=args.quantization)
    startup = time.perf_counter() - start
    run_workload(llm, warm_up_workload(workload), 0.0)
    res = run_workload(llm, workload, 0.0)
    memory = process_memory()
    import torch

    return {"engine": "everystop", "dtype": args.dtype, "threads": torch.get_num_threads(),
            "cpu_kernels": args.cpu_kernels, "max_num_seqs": args.everystop_max_num_seqs,
            "tpot_target_ms": args.tpot_target_ms,
            "model": args.model, "quantization": args.quantization,
            "kv_cache": llm.engine.executor.describe_capacity(), "startup_s": startup,
            # This process's peak: the engine's, plus the small client llama.cpp's run used.
            "rss_end_bytes": memory["rss_bytes"], "peak_rss_bytes": memory["peak_rss_bytes"],
            **res}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--llama-server", required=True, help="path to a llama-server binary")
    ap.add_argument("--gguf", required=True, help="GGUF for llama.cpp (e.g. an F16 conversion)")
    ap.add_argument("--model", help="everystop's model (default: the default model); for a "
                    "like-for-like run, the same GGUF as --gguf with --quantization auto")
    ap.add_argument("--length-scale", type=float, default=1.0,
                    help="scale every prompt and output length of the workload (0 < F <= 1)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--workload", help="workload JSON (default: the committed perf-mixed-128)")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--slots", type=int, default=32, help="llama.cpp slots (-np)")
    ap.add_argument("--everystop-max-num-seqs", type=int, default=128)
    ap.add_argument("--cpu-kernels", default="auto", help="everystop's kernel build")
    ap.add_argument("--quantization", default="none",
                    help="everystop's weights in memory (default none: --dtype throughout, like "
                    "for like with an F16 GGUF; auto keeps the default model's Q4_1 blocks)")
    ap.add_argument("--tpot-target-ms", type=lambda v: None if v == "auto" else float(v),
                    default=0.0,
                    help="everystop's step-time target: 0 = off (default; every request arrives "
                         "at t=0, so throughput and TTFT are what is compared), auto, or ms")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--extra", default="", help="extra llama-server flags")
    ap.add_argument("--port", type=int, default=0, help="llama-server's port (0: a free one)")
    ap.add_argument("--kv-cache-gib", type=float, default=3.0)
    ap.add_argument("--order", default="llamacpp,everystop")
    ap.add_argument("--server-log")
    ap.add_argument("--note",
                    help="a sentence kept in the JSON (e.g. how this run maps an older one's)")
    ap.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    from everystop.bench.throughput import load_perf_workload

    workload = scale_lengths(load_perf_workload(args), args.length_scale)
    reqs = workload.to_dict()["requests"]  # llama.cpp's client sends their token ids
    out: dict[str, Any] = {"bench": "vs-llamacpp", "num_requests": len(reqs),
                           "length_scale": args.length_scale,
                           "llamacpp_slots": args.slots,
                           "prompt_tokens": sum(r["prompt_len"] for r in reqs),
                           "expected_output_tokens": sum(r["max_tokens"] for r in reqs),
                           "load_avg_before": os.getloadavg()}
    if args.note:
        out["note"] = args.note
    for name in args.order.split(","):
        out[name] = run_llamacpp(args, reqs) if name == "llamacpp" else run_everystop(args,
                                                                                      workload)
    if "llamacpp" in out and "everystop" in out:
        out["throughput_ratio"] = out["everystop"]["output_tok_s"] / out["llamacpp"]["output_tok_s"]
        out["ttft_p99_ratio"] = out["everystop"]["ttft_p99_s"] / out["llamacpp"]["ttft_p99_s"]
    out["load_avg_after"] = os.getloadavg()
    write_result(out, args.out)
    return 0
