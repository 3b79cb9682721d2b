"""Worst GET /health latency while one client sends a huge request (issue #17: a 10 MB prompt
used to freeze every client for 16-18 s while it was tokenized on the event loop).

Starts `everystop serve` (default model) on a free loopback port, probes /health every
--interval seconds from a thread, and meanwhile sends, one after another, a --mb megabyte
prompt to /v1/completions, /v1/chat/completions and /tokenize. For each it records the
status, how long the big request took, and the worst /health latency while it was in flight.
With --compare-src the same run is repeated against another checkout's sources (e.g. main),
side by side in one JSON.

    everystop bench health-big-request --compare-src /work/main/src \\
        --out benchmarks/results/health_big_request.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shlex
import time
from typing import Any

import httpx

from everystop.bench.servers import SRC, everystop_server
from everystop.results import write_result


def _probe_loop(url: str, interval_s: float, stop: Any, out: Any) -> None:
    """The prober's own process: GET /health every interval_s until `stop`, then send back
    the (start, latency) samples. NOTE: a thread of the client would share its GIL with the
    code sending 10 MB and reading the answer, and measure that as /health latency."""
    samples = []
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            t0 = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
            http.get(url + "/health")
            samples.append((t0, time.monotonic() - t0))
            time.sleep(interval_s)
    out.send(samples)


class Prober:
    """/health probes from a separate process; their windows are read after `finish()`."""

    def __init__(self, url: str, interval_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_probe_loop, args=(url, interval_s, self._stop, send),
                                 daemon=True)
        self.samples: list[tuple[float, float]] = []  # (start, latency)

    def start(self) -> None:
        self._proc.start()

    def finish(self) -> None:
        self._stop.set()
        self.samples = self._recv.recv()
        self._proc.join(timeout=130)

    def window(self, start: float, end: float) -> dict[str, Any]:
        """Probes that overlapped [start, end] (one spanning all of it included): their worst
        latency, and the longest stretch with no probe answered, which also catches a
        prober that could not send at all."""
        inside = [(t, lat) for t, lat in self.samples if t <= end and t + lat >= start]
        done = sorted([start] + [t + lat for t, lat in inside] + [end])
        gaps = [b - a for a, b in zip(done, done[1:])]
        return {"probes": len(inside),
                "worst_health_ms": round(1e3 * max((lat for _, lat in inside),
                                                   default=float("nan")), 1),
                "longest_unanswered_ms": round(1e3 * max(gaps), 1)}


def measure(src: str, mb: float, interval_s: float, extra: list[str]) -> dict[str, Any]:
    flags = ["--log-level", "warning", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
             "--kv-cache-memory", "128MiB", *extra]
    with everystop_server(flags, src=src, failure=f"server from {src} did not come up") as (_, url):
        text = ("The quick brown fox jumps over the lazy dog. " * int(mb * 30_000))
        text = text[:int(mb * 1_000_000)]
        bodies = {"/v1/completions": {"prompt": text, "max_tokens": 4},
                  "/v1/chat/completions": {"messages": [{"role": "user", "content": text}],
                                           "max_tokens": 4},
                  "/tokenize": {"prompt": text}}
        prober = Prober(url, interval_s)
        prober.start()
        time.sleep(2.0)  # the prober process starts (spawn) and settles
        idle_from = time.monotonic()
        time.sleep(1.0)
        idle_to = time.monotonic()
        spans, answers = {}, {}
        for path, body in bodies.items():
            raw = json.dumps(body).encode()  # encoded before the clock starts
            t0 = time.monotonic()
            r = httpx.post(url + path, content=raw, timeout=600,
                           headers={"content-type": "application/json"})
            t1 = time.monotonic()
            time.sleep(3 * interval_s)
            spans[path], answers[path] = (t0, t1), r
        prober.finish()
        rows = {path: {"status": answers[path].status_code, "request_s": round(t1 - t0, 3),
                       **prober.window(t0, t1), "answer": answers[path].text[:160]}
                for path, (t0, t1) in spans.items()}
        idle = prober.window(idle_from, idle_to)["worst_health_ms"]
        return {"src": src, "server_flags": extra, "idle_worst_health_ms": idle,
                "prober": "a separate process", "requests": rows}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mb", type=float, default=10.0, help="prompt size in MB")
    ap.add_argument("--interval", type=float, default=0.02, help="seconds between probes")
    ap.add_argument("--compare-src", default=None, help="another tree's src/ to run as well")
    ap.add_argument("--compare-flags", default="",
                    help="server flags for the --compare-src run, e.g. "
                    "--compare-flags=--max-body-bytes=13MB for a tree that has the body limit")
    ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    # Raise the body limit above the prompt so the request reaches the work it used to freeze.
    flags = ["--max-body-bytes", f"{int(args.mb * 1.2 + 1)}MB"]
    runs = [measure(str(SRC), args.mb, args.interval, flags)]
    if args.compare_src:
        runs.append(measure(args.compare_src, args.mb, args.interval,
                            shlex.split(args.compare_flags)))
    write_result({"benchmark": "health_big_request", "prompt_mb": args.mb,
                  "probe_interval_s": args.interval, "runs": runs}, args.out)
    return 0
