"""`everystop serve` with no flags against llama.cpp's server, both driven by the same OpenAI
client over loopback: the 128-request mixed workload at once, a single stream, each server's
peak resident memory, its start-up time to /health, and the single stream's share of the
weight-streaming bound. Without --llama-server, everystop's side alone.

    everystop bench served --llama-server /path/to/llama-server \\
        --gguf FILE --out benchmarks/results/cpu/KIND/served_q4_1.json

Both servers get the same prompt token ids (tokenized once with the default model's tokenizer,
so the model must share it), ignore_eos and greedy sampling. Each scenario starts each server
afresh, so a single stream's peak memory is a single stream's. everystop runs with no flags but
`--model` (omitted for the default model); llama.cpp with its threads, and its slots and their
context for the concurrent scenario (its defaults otherwise).

The bound: a single-sequence decode step reads every weight once (the GGUF's tensor bytes; a
tied embedding is the LM head; of a mixture of experts, the chosen experts' share), so the
step's floor is those bytes over the read bandwidth measured in the same run (`bench
roofline`'s copy test); the share is that floor over the measured TPOT p50.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from everystop.bench.client import ServeOptions, run_serve
from everystop.bench.servers import everystop_server, llama_server, process_memory
from everystop.bench.sweep import tokenize_prompts
from everystop.results import write_result
from everystop.workload import Workload, load_workload, perf_workload

# (base URL, pid, exact command) of a started server
Started = tuple[str, int, list[str]]


def step_weight_bytes(path: str) -> int:
    """The weight bytes one single-sequence decode step reads from a GGUF file: every tensor,
    but the token embedding only where it is also the LM head (tied; else one row is read),
    and of each layer's stacked experts only the chosen share (used / count)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())

    def key(name: str) -> int:
        field = reader.fields.get(f"{arch}.{name}")
        return int(field.contents()) if field is not None else 0

    experts, used = key("expert_count"), key("expert_used_count")
    names = {t.name for t in reader.tensors}
    total = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        share = used / experts if "_exps." in t.name and experts else 1.0
        total += int(int(t.n_bytes) * share)
    return total


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    s = report["summary"]
    return {k: s[k] for k in ("completed", "failed", "duration_s", "output_tokens",
                              "output_throughput", "ttft_ms", "tpot_ms", "itl_ms")}


def _drive(url: str, workload: Workload, ids: dict[str, list[int]],
           concurrency: int | None) -> dict[str, Any]:
    # The model name each server lists first (GET /v1/models).
    opts = ServeOptions(base_url=url, max_concurrency=concurrency, progress=False,
                        prompt_token_ids=ids, timeout_s=3600.0)
    warm = ServeOptions(base_url=url, progress=False, prompt_token_ids=ids)
    asyncio.run(run_serve(workload.head(1), warm))  # kernels and caches warm
    return _summary(asyncio.run(run_serve(workload, opts)))


def _scenario(start: Callable[[bool], AbstractContextManager[Started]], workload: Workload,
              ids: dict[str, list[int]], concurrency: int | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    with start(concurrency == 1) as (url, pid, command):
        to_health = time.perf_counter() - t0
        result = _drive(url, workload, ids, concurrency)
        memory = process_memory(pid)
    return {"command": command, "start_to_health_s": to_health, **result,
            "peak_rss_bytes": memory["peak_rss_bytes"]}


def _starters(args: argparse.Namespace, longest: int
              ) -> dict[str, Callable[[bool], AbstractContextManager[Started]]]:
    """Each server's start, given whether it serves a single stream: everystop the same way
    always; llama.cpp with its slots for many streams, and its own defaults (but threads) for
    one, so a single stream's memory is not charged for 32 slots' caches."""

    @contextmanager
    def everystop(single: bool) -> Iterator[Started]:
        flags = ["--model", args.model] if args.model else []
        flags += args.everystop_flags.split()
        with everystop_server(flags) as (proc, url):
            yield url, proc.pid, ["everystop", "serve", *flags]

    @contextmanager
    def llamacpp(single: bool) -> Iterator[Started]:
        slots = [] if single else ["-np", str(args.slots), "-c", str(args.slots * longest)]
        flags = [*slots, "-t", str(args.threads), "-tb", str(args.threads),
                 *args.llama_flags.split()]
        with llama_server(args.llama_server, args.gguf, flags) as server:
            yield server.url, server.proc.pid, server.command

    return {"everystop": everystop, "llamacpp": llamacpp}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--llama-server", help="path to a llama-server binary (none: measure "
                    "everystop alone)")
    ap.add_argument("--gguf", required=True, help="the GGUF both servers load")
    ap.add_argument("--model", help="everystop's --model (default: --gguf; 'default': omit it)")
    ap.add_argument("--everystop-flags", default="", help="flags added to everystop serve "
                    "(default none: its defaults are what is measured)")
    ap.add_argument("--llama-flags", default="", help="flags added to llama-server")
    ap.add_argument("--slots", type=int, default=32, help="llama.cpp slots (-np)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--workload", help="the concurrent scenario's workload JSON (default: the "
                    "benchmarks' perf workload)")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--single-workload", default="benchmarks/workloads/single-16.json")
    ap.add_argument("--single-requests", type=int, default=16)
    ap.add_argument("--scenarios", default="concurrent,single")
    ap.add_argument("--order", default="llamacpp,everystop")
    ap.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    from everystop.bench.cli import default_tokenizer
    from everystop.bench.roofline import read_bandwidth_gb_s

    if args.model is None:
        args.model = args.gguf
    elif args.model == "default":
        args.model = None
    tokenizer = default_tokenizer()
    if tokenizer is None:
        raise SystemExit("bench served needs the default model's tokenizer")
    workloads = {"concurrent": (perf_workload(args.num_requests, args.workload), None),
                 "single": (load_workload(args.single_workload).head(args.single_requests), 1)}
    longest = max(r.prompt_len + r.max_tokens for w, _ in workloads.values()
                  for r in w.requests) + 64
    starters = _starters(args, longest)
    out: dict[str, Any] = {"bench": "served", "gguf": args.gguf,
                           "weight_bytes": step_weight_bytes(args.gguf),
                           "load_avg_before": os.getloadavg()}
    for scenario in args.scenarios.split(","):
        workload, concurrency = workloads[scenario]
        ids = tokenize_prompts(workload, tokenizer)
        out[scenario] = {"workload": workload.name, "num_requests": len(workload.requests),
                         "max_concurrency": concurrency}
        for name in args.order.split(","):
            if name == "llamacpp" and not args.llama_server:
                continue
            out[scenario][name] = _scenario(starters[name], workload, ids, concurrency)
    bandwidth = read_bandwidth_gb_s()
    out["read_bandwidth_gb_s"] = bandwidth
    floor_ms = out["weight_bytes"] / (bandwidth * 1e9) * 1e3
    out["weight_stream_floor_ms"] = floor_ms
    for r in out.get("single", {}).values():
        if isinstance(r, dict) and "tpot_ms" in r:
            r["bound_share"] = floor_ms / r["tpot_ms"]["p50"]
    for scenario, key in (("concurrent", "output_throughput"), ("single", None)):
        both = out.get(scenario, {})
        if "everystop" in both and "llamacpp" in both:
            e, ll = both["everystop"], both["llamacpp"]
            both["ratios"] = ({"output_tok_s": e[key] / ll[key]} if key else
                              {"tpot_p50": e["tpot_ms"]["p50"] / ll["tpot_ms"]["p50"]})
            both["ratios"]["peak_rss"] = e["peak_rss_bytes"] / ll["peak_rss_bytes"]
    out["load_avg_after"] = os.getloadavg()
    write_result(out, args.out)
    return 0
