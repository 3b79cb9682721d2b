"""How fast `everystop serve` comes up and what its process holds (issue 43).

Starts the server twice on fresh caches: the first start builds the CPU kernels (an empty
TORCH_EXTENSIONS_DIR) and measures the preemption costs and converts the GGUF's tokenizer (an
empty EVERYSTOP_CACHE_DIR); the second start finds all three cached. Each start is timed from
the process's launch to the first /health 200. The second server's memory is broken down by
the resident-memory checkpoints it logs at start-up (everystop/startup_memory.py: interpreter,
imports, weights, KV pool, tokenizer, ...), then it serves a single stream of a few
completions, and the table adds what serving grew (KV pages touched, by mincore; activations,
oneDNN and ATen caches, the rest) and the peak (VmHWM).

`--cached-only`: one start on the caches this machine already has; `--quick` (a smoke
test): that, with two short requests.

    everystop bench startup --out benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from everystop.bench.servers import SRC, child_env, free_port, stop_process
from everystop.results import write_result
from everystop.startup_memory import parse_stages, read_status

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MIB = 2**20


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=None, help="result JSON (default: printed only)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: one start on the existing caches, two short requests")
    ap.add_argument("--cached-only", action="store_true",
                    help="skip the first start (kernels built): one start on this machine's "
                         "caches")
    ap.add_argument("--requests", type=int, default=5, help="single-stream completions")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds a start may take (the first builds the kernels)")
    ap.add_argument("server_flags", nargs=argparse.REMAINDER,
                    help="after --: flags for `everystop serve` (e.g. --model FILE)")


def run(args: argparse.Namespace) -> int:
    flags = [f for f in args.server_flags if f != "--"]
    requests, max_tokens = (2, 8) if args.quick else (args.requests, args.max_tokens)
    starts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="everystop-startup-") as tmp:
        fresh = {"TORCH_EXTENSIONS_DIR": os.path.join(tmp, "torch_extensions"),
                 "EVERYSTOP_CACHE_DIR": os.path.join(tmp, "everystop")}
        cached_only = args.quick or args.cached_only
        if not cached_only:
            starts["first"] = _start(flags, fresh, tmp, args.timeout, 0, 0)
        starts["second"] = _start(flags, {} if cached_only else fresh, tmp, args.timeout,
                                  requests, max_tokens)
    second = starts["second"]
    result = {
        "target": {"second_start_to_health_s_under": 10.0},
        "quick": args.quick,
        "server_flags": flags,
        "starts": {k: {"to_health_s": v["to_health_s"], "command": v["command"],
                       "caches": v["caches"]} for k, v in starts.items()},
        "stages": second["stages"],
        "memory_breakdown_mib": breakdown(second["stages"], second["after"]),
        "single_stream": {"requests": requests, "max_tokens": max_tokens,
                          "completion_tokens": second["completion_tokens"]},
        "peak_rss_mib": round(second["after"].get("peak_rss_bytes", 0) / MIB, 1),
        "rss_after_mib": round(second["after"].get("rss_bytes", 0) / MIB, 1),
        "after_single_stream": second["after"],
    }
    write_result(result, args.out)
    print(format_table(result), file=sys.stderr)
    return 0


def _start(flags: list[str], env: dict[str, str], tmp: str, timeout_s: float,
           requests: int, max_tokens: int) -> dict[str, Any]:
    """Launch a server, time it to /health 200, serve `requests` completions one at a time,
    read its memory, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "everystop", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--log-level", "debug", *flags]
    log_path = Path(tmp) / f"server-{port}.log"
    with open(log_path, "w") as log:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=SRC.parent, env=child_env(SRC, **env),
                                stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)
        try:
            to_health = _time_to_health(proc, url, started, timeout_s, log_path)
            tokens = 0
            with httpx.Client(timeout=300) as client:
                for _ in range(requests):
                    r = client.post(url + "/v1/completions", json={
                        "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True})
                    r.raise_for_status()
                    tokens += r.json()["usage"]["completion_tokens"]
                after = {**read_status(proc.pid), "kv_pool_resident_bytes":
                         _metric(client.get(url + "/metrics").text,
                                 "everystop:kv_pool_resident_bytes")}
        finally:
            stop_process(proc)
    return {"to_health_s": round(to_health, 2), "command": cmd,
            "caches": {k: "fresh (empty)" for k in env} or "this machine's",
            "stages": parse_stages(log_path.read_text()), "after": after,
            "completion_tokens": tokens}


def _die_with_parent() -> None:
    """In the server's process before exec: the kernel sends it SIGTERM when this benchmark
    dies, so a benchmark killed outright (a test's timeout) leaves no server behind. Linux
    only; elsewhere a no-op."""
    import ctypes
    import ctypes.util
    import signal

    name = ctypes.util.find_library("c")
    if name and sys.platform.startswith("linux"):
        ctypes.CDLL(name).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _time_to_health(proc: subprocess.Popen, url: str, started: float, timeout_s: float,
                    log_path: Path) -> float:
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"everystop serve exited ({proc.returncode}):\n"
                             + log_path.read_text()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"everystop serve was not healthy in {timeout_s:g} s")


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name or key.startswith(name + "{"):
            return float(value)
    return None


# What each start-up stage's RSS growth is, by the checkpoint that ends it.
_STAGE_PARTS = {
    "interpreter": "interpreter (python, everystop's CLI)",
    "server imports": "server imports (FastAPI, uvicorn, pydantic, prometheus)",
    "torch import": "torch import (libtorch, ATen op registry, numpy)",
    "weights": "weights (+ the loader's staging)",
    "KV pool": "KV pool at start (allocated, untouched)",
    "tokenizer": "tokenizer",
    "preemption cost probes": "preemption cost probes (cached after the first start)",
    "engine": "engine (scheduler, structured output)",
    "app": "app (routes, telemetry, dashboard)",
    "ready": "start-up heap trim",
}


def breakdown(stages: list[dict[str, Any]], after: dict[str, Any]) -> dict[str, float]:
    """MiB of RSS each stage added (a negative one returned memory), then what serving the
    single stream added: KV pages it touched (mincore) and the rest (activations, oneDNN and
    ATen caches, allocator arenas), the RSS after it, and the peak."""
    out: dict[str, float] = {}
    previous = 0
    for row in stages:
        name = _STAGE_PARTS.get(row["stage"], row["stage"])
        out[name] = round((row["rss_bytes"] - previous) / MIB, 1)
        previous = row["rss_bytes"]
    kv = after.get("kv_pool_resident_bytes") or 0
    grown = after.get("rss_bytes", previous) - previous
    out["serving: KV pages touched"] = round(kv / MIB, 1)
    out["serving: activations, oneDNN/ATen caches, arenas"] = round((grown - kv) / MIB, 1)
    out["RSS after the single stream"] = round(after.get("rss_bytes", 0) / MIB, 1)
    out["peak RSS (VmHWM)"] = round(after.get("peak_rss_bytes", 0) / MIB, 1)
    return out


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'start':<8} {'to /health (s)':>15}"]
    lines += [f"{k:<8} {v['to_health_s']:>15.2f}" for k, v in result["starts"].items()]
    lines += ["", f"{'what the serving process holds':<58} {'MiB':>8}"]
    lines += [f"{k:<58} {v:>8.1f}" for k, v in result["memory_breakdown_mib"].items()]
    return "\n".join(lines)
