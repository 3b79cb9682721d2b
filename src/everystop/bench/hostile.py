"""/health's latency while each hostile request of the robustness suite is served, at full
size (everystop.bench.hostile_cases), against one `everystop serve` of the default model on
loopback, never restarted between cases.

For each case a prober asks /health every --probe-interval-ms (one keep-alive connection,
the next probe one interval after the last began, or at once if it took longer) from the
moment the hostile request is sent until it and --innocent streamed completions sent beside it
have all finished, and at least --min-window-s. The slowloris case opens 200 connections that
never finish their headers and is probed until the server has closed them all (the header
deadline, --header-timeout). Judged per case: /health p99 < 100 ms and worst < 250 ms, the
hostile request's status is the documented one, no innocent stream failed. At the end: KV
blocks in use and the server's RSS net of the KV pools' resident pages, against a warm start.

    everystop bench hostile --out benchmarks/results/hostile_health_latency.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from everystop.bench import perf_page
from everystop.bench.hostile_cases import (
    SLOWLORIS_CONNECTIONS,
    HostileCase,
    closed_by_server,
    hostile_cases,
    names_its_limit,
    open_slowloris,
)
from everystop.bench.metrics import distribution_ms
from everystop.bench.servers import everystop_server
from everystop.results import write_result

P99_MS, WORST_MS = 100.0, 250.0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=str(perf_page.RESULTS / "hostile_health_latency.json"))
    ap.add_argument("--probe-interval-ms", type=float, default=20.0)
    ap.add_argument("--min-window-s", type=float, default=1.0,
                    help="probe at least this long per case (a refusal takes milliseconds)")
    ap.add_argument("--innocent", type=int, default=3,
                    help="streamed completions sent beside each hostile request")
    ap.add_argument("--header-timeout", type=float, default=10.0,
                    help="the server's header deadline (the slowloris case waits it out)")
    ap.add_argument("--only", nargs="*", help="run only these cases (names)")
    ap.add_argument("--notes", default="", help="what to know about the machine or the run")


def _probe(url: str, interval_s: float, ready: Any, stop: Any, conn: Any) -> None:
    """The prober's process: probes until `stop` is set, then sends [(seconds, ok), ...]."""
    samples: list[tuple[float, bool]] = []
    with httpx.Client(timeout=30) as client:
        client.get(url + "/health")  # the connection, opened before the clock starts
        ready.set()
        while not stop.is_set():
            start = time.monotonic()
            try:
                ok = client.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            took = time.monotonic() - start
            samples.append((took, ok))
            stop.wait(max(0.0, interval_s - took))
    conn.send(samples)


class Prober:
    """/health latencies, one probe per interval, until stopped: from a process of its own, so
    that the benchmark's own work (megabyte bodies to send and read) does not delay it."""

    def __init__(self, url: str, interval_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self._conn, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_probe, args=(url, interval_s, self._ready, self._stop,
                                                      child), daemon=True)
        self._proc.start()
        if not self._ready.wait(60):
            raise SystemExit("the /health prober did not start")

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        samples = self._conn.recv()
        self._proc.join()
        latencies = [s for s, _ in samples]
        dist = distribution_ms(latencies)
        return {"probes": len(samples), "failed": sum(not ok for _, ok in samples),
                "p50_ms": round(dist["p50"], 2), "p99_ms": round(dist["p99"], 2),
                "worst_ms": round(max(latencies, default=float("nan")) * 1000, 2)}


def _innocent(url: str) -> bool:
    """One streamed completion to its [DONE]; whether it got there."""
    body = {"prompt": "Once upon a time", "max_tokens": 16, "stream": True, "temperature": 0}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        return r.status_code == 200 and lines[-1:] == ["data: [DONE]"]
    except httpx.HTTPError:
        return False


def _run_case(url: str, case: HostileCase, args: argparse.Namespace) -> dict[str, Any]:
    raw = case.raw_body()
    before = _scrape(url)
    start = time.monotonic()
    prober = Prober(url, args.probe_interval_ms / 1000)
    with ThreadPoolExecutor(args.innocent + 1) as pool:
        answer = pool.submit(httpx.post, url + case.path, content=raw, timeout=600,
                             headers={"content-type": "application/json"})
        innocents = [pool.submit(_innocent, url) for _ in range(args.innocent)]
        r = answer.result()
        served_s = time.monotonic() - start
        failed = sum(not f.result() for f in innocents)
    time.sleep(max(0.0, args.min_window_s - (time.monotonic() - start)))
    health = prober.stop()
    named = True
    if case.names is not None and r.status_code == case.status:
        named = names_its_limit(r.json().get("error", {}), case.names)
    return {"request_bytes": len(raw), "status": r.status_code, "expected_status": case.status,
            "error_names_the_limit": named, "served_s": round(served_s, 3),
            "innocent_failed": failed, "health": health,
            "server_loop_lag_samples": _loop_lags_over(before, _scrape(url))}


def _run_slowloris(url: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    before = _scrape(url)
    start = time.monotonic()
    prober = Prober(url, args.probe_interval_ms / 1000)
    socks = open_slowloris(port)
    try:
        closed = closed_by_server(socks, args.header_timeout + 10)
    finally:
        for sock in socks:
            sock.close()
    served_s = time.monotonic() - start
    health = prober.stop()
    return {"connections": SLOWLORIS_CONNECTIONS, "closed_by_server": closed,
            "served_s": round(served_s, 3), "innocent_failed": int(not _innocent(url)),
            "health": health, "server_loop_lag_samples": _loop_lags_over(before, _scrape(url))}


def _judge(result: dict[str, Any]) -> bool:
    h = result["health"]
    status_ok = (result.get("status") == result.get("expected_status")
                 and result.get("error_names_the_limit", True)
                 if "status" in result else result["closed_by_server"] == result["connections"])
    return (status_ok and h["failed"] == 0 and h["p99_ms"] < P99_MS and h["worst_ms"] < WORST_MS
            and result["innocent_failed"] == 0)


def _scrape(url: str) -> dict[str, float]:
    """From /metrics: RSS, the KV pools' resident bytes, KV blocks in use, and the loop-lag
    histogram's cumulative counts ("lag_le_0.1", "lag_le_+Inf", ...)."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("everystop:event_loop_lag_seconds_bucket{"):
            values["lag_le_" + name.split('le="', 1)[1].split('"', 1)[0]] = float(value)
            continue
        for metric in ("process_resident_memory_bytes", "kv_pool_resident_bytes",
                       "kv_cache_used_blocks"):
            if name == f"everystop:{metric}" or name.startswith(f"everystop:{metric}{{"):
                values[metric] = float(value)
    return values


def _loop_lags_over(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How many of the server's own loop-lag samples taken in between were over 0.1 and
    0.25 s: a slow probe with none is the host's scheduling or the network path, not a stall
    of the server's event loop."""
    total = after["lag_le_+Inf"] - before["lag_le_+Inf"]
    return {f"over_{b}s": total - (after[f"lag_le_{b}"] - before[f"lag_le_{b}"])
            for b in ("0.1", "0.25")}


def run(args: argparse.Namespace) -> int:
    flags = ["--max-body-bytes", "32MiB", "--header-timeout", str(args.header_timeout),
             "--log-level", "warning"]
    cases = [c for c in hostile_cases() if not args.only or c.name in args.only]
    results: dict[str, dict[str, Any]] = {}
    with everystop_server(flags, failure="everystop serve did not come up") as (_proc, url):
        port = int(url.rsplit(":", 1)[1])
        for _ in range(2):  # warm-up: the worker pool, the tokenizer, the decode shapes
            with ThreadPoolExecutor(args.innocent) as pool:
                list(pool.map(lambda _: _innocent(url), range(args.innocent)))
        start_memory = _scrape(url)
        for case in cases:
            results[case.name] = _run_case(url, case, args)
            print(case.name, json.dumps(results[case.name]), flush=True)
        if not args.only or "slowloris_200" in args.only:
            results["slowloris_200"] = _run_slowloris(url, port, args)
            print("slowloris_200", json.dumps(results["slowloris_200"]), flush=True)
        time.sleep(2)  # the last streams' blocks are freed after their final event
        end_memory = _scrape(url)
    for result in results.values():
        result["pass"] = _judge(result)

    def net(m: dict[str, float]) -> float:
        return m.get("process_resident_memory_bytes", 0) - m.get("kv_pool_resident_bytes", 0)

    write_result({
        "target": {"health_p99_ms_under": P99_MS, "health_worst_ms_under": WORST_MS},
        "probe_interval_ms": args.probe_interval_ms, "innocent_streams_per_case": args.innocent,
        "server_flags": flags, "cases": results,
        "all_pass": all(r["pass"] for r in results.values()),
        "after": {"kv_cache_used_blocks": end_memory.get("kv_cache_used_blocks"),
                  # informational: the start is after 2 x --innocent completions, before any
                  # case, so it counts what the first of each case builds (the test suite
                  # judges RSS after a warm round, with the heap trimmer every second)
                  "rss_net_of_kv_pool_mib_start_end": [round(net(start_memory) / 2**20, 1),
                                                       round(net(end_memory) / 2**20, 1)]},
        "notes": args.notes,
    }, args.out)
    return 0
