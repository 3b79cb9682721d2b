"""GET /health latency while the engine is saturated (every sequence slot busy).

Starts `everystop serve` (or the toy-engine server with --toy) on a free loopback port, opens
--clients streaming completions (ignore_eos, long max_tokens) from a separate load process so
the prober's own event loop is not busy reading streams, waits until
everystop:num_requests_running reaches --max-num-seqs, then sends --probes sequential GET /health
requests and reports their latency percentiles, plus how full the engine was during the probes.

    everystop bench health-under-load --out benchmarks/results/health_under_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Literal

import httpx

from everystop.bench.servers import SRC, child_env, everystop_server
from everystop.results import write_result
from everystop.stats import percentile

NEAREST_RANK: Literal["inverted_cdf"] = "inverted_cdf"  # p99 of 50 probes is the largest
ROOT = SRC.parent  # the checkout: --toy runs its tests.server.toy_server


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith((name + " ", name + "{")):  # every series has a model_name label
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def _load(url: str, clients: int, max_tokens: int, model: str) -> None:
    """The load process: `clients` concurrent streams, read to the end (or until killed)."""
    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        async def one(i: int) -> None:
            body = {"model": model, "prompt": f"Request {i}: tell me a long story about ships.",
                    "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_raw():
                    pass
        await asyncio.gather(*(one(i) for i in range(clients)), return_exceptions=True)


def _probe(url: str, probes: int, interval_s: float) -> tuple[list[float], list[float]]:
    latencies, running = [], []
    with httpx.Client(base_url=url, timeout=10) as http:
        for _ in range(probes):
            t0 = time.perf_counter()
            r = http.get("/health")
            latencies.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            running.append(_metric(url, "everystop:num_requests_running"))
            time.sleep(interval_s)
    return latencies, running


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--toy", action="store_true", help="toy engine (no model) instead")
    ap.add_argument("--toy-step-delay", type=float, default=0.05)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--clients", type=int, default=136, help="a few more than the slots")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--probes", type=int, default=50)
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between probes")
    ap.add_argument("--saturate-timeout", type=float, default=300.0)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra flag for the server (repeat)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/health_under_load.json"))
    ap.add_argument("--load-role", nargs=3, metavar=("URL", "CLIENTS", "MAX_TOKENS"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--model-name", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.load_role:
        url, clients, max_tokens = args.load_role
        asyncio.run(_load(url, int(clients), int(max_tokens), args.model_name or ""))
        return 0
    seqs = str(args.max_num_seqs)
    flags = ["--log-level", "warning", "--max-num-seqs", seqs,
             "--max-num-batched-tokens", str(max(2048, 2 * int(seqs)))]
    argv: tuple[str, ...] = ("-m", "everystop", "serve")
    if args.toy:
        argv = ("-m", "tests.server.toy_server")
        flags += ["--step-delay", str(args.toy_step_delay), "--num-gpu-blocks", "20000",
                  "--max-model-len", "4096"]
    flags += args.server_arg
    load = None
    with everystop_server(flags, argv=argv, python_path=[ROOT]) as (_, url):
        try:
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            idle, _ = _probe(url, 10, 0.01)
            load = subprocess.Popen([sys.executable, "-m", "everystop", "bench",
                                     "health-under-load", "--model-name", model, "--load-role",
                                     url, str(args.clients), str(args.max_tokens)],
                                    env=child_env(SRC))
            t0 = time.monotonic()
            while _metric(url, "everystop:num_requests_running") < args.max_num_seqs:
                if time.monotonic() - t0 > args.saturate_timeout:
                    raise SystemExit("the engine never filled its slots")
                time.sleep(0.1)
            saturated_after = time.monotonic() - t0
            latencies, running = _probe(url, args.probes, args.interval)
            steps = _metric(url, "everystop:iteration_latency_seconds_count")
            step_sum = _metric(url, "everystop:iteration_latency_seconds_sum")
        finally:
            if load is not None:
                load.kill()
                load.wait(timeout=10)
    ms = [x * 1000 for x in latencies]
    p90, p99 = (percentile(ms, q, method=NEAREST_RANK, empty=math.nan) for q in (90, 99))
    result = {
        "benchmark": "health_under_load", "toy_engine": args.toy,
        "max_num_seqs": args.max_num_seqs, "clients": args.clients,
        "max_tokens": args.max_tokens, "probes": args.probes,
        "probe_interval_s": args.interval,
        "health_ms": {"p50": statistics.median(ms), "p90": p90, "p99": p99, "max": max(ms),
                      "mean": statistics.fmean(ms)},
        "idle_health_ms_p50": statistics.median(x * 1000 for x in idle),
        "running_during_probes": {"min": min(running), "max": max(running)},
        "seconds_to_saturate": round(saturated_after, 2),
        "mean_engine_step_s": step_sum / steps if steps else None,
        "meets_100ms_p99": p99 < 100.0,
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(),
                 "machine": platform.machine()},
        "server_cmd": " ".join([*argv[1:], *flags]),
    }
    write_result(result, args.out)
    return 0
