"""Start-up time: `everystop generate` to its answer, and `everystop serve` to its first
/health 200, each a fresh process on the default model.

Runs alternate between the source trees given (this one, and optionally `--baseline-src`, an
older checkout), so a before/after pair shares the machine's load. Wall times per run, their
median, and the load average go into the result JSON.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from everystop.bench.servers import child_env, wait_healthy
from everystop.results import write_result

PROMPT = "What is the capital of France?"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", type=int, default=3, help="runs per tree and command")
    ap.add_argument("--baseline-src", default=None,
                    help="another tree's src/ to time side by side (e.g. main's)")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/startup.json")


def run(args: argparse.Namespace) -> int:
    here = str(Path(__file__).resolve().parents[2])
    trees = {"this": here, **({"baseline": args.baseline_src} if args.baseline_src else {})}
    times: dict[str, dict[str, list[float]]] = {t: {"generate_s": [], "serve_health_s": []}
                                                for t in trees}
    for _ in range(args.runs):
        for name, src in trees.items():
            times[name]["generate_s"].append(_time_generate(src, args.max_tokens))
            times[name]["serve_health_s"].append(_time_serve(src))
    result: dict[str, Any] = {
        "benchmark": "startup", "prompt": PROMPT, "max_tokens": args.max_tokens,
        "trees": trees, "runs": times,
        "median": {t: {k: statistics.median(v) for k, v in m.items()} for t, m in times.items()},
    }
    write_result(result, args.out)
    return 0


def _time_generate(src: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "everystop", "generate", PROMPT, "--max-tokens",
                    str(max_tokens)], env=child_env(src), check=True, capture_output=True)
    return time.perf_counter() - t0


def _time_serve(src: str) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "everystop", "serve", "--host", "127.0.0.1",
                             "--port", str(port)], env=child_env(src), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", "the server exited before /health",
                     timeout_s=120, poll_s=0.05)
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
