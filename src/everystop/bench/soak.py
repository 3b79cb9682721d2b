"""Soak: a live `everystop serve` under mixed Poisson traffic with hostile and unlucky clients,
judged on what must hold over time. Not in CI: 20 minutes on a quiet machine.

Phases: start the server (default model, small limits); calibrate capacity with a closed loop
of --max-num-seqs streaming clients; then --minutes of open-loop Poisson arrivals at
--load x capacity, where each arrival is

  bad input (--bad, 2%)          a malformed body from a fixed list: must be 4xx
  slow reader (--slow, 1%)       reads one chunk, then nothing for longer than the server's
                                 --slow-reader-timeout, then leaves
  disconnect (--disconnect, 10%) streams, leaves after 1-5 chunks
  valid (the rest)               streams to the end; tier 0/1/2, one of 8 tenants

while /health is probed every 100 ms and the scheduler config is hot-reloaded every minute.
Judged at the end: 5xx on valid requests (must be 0), KV blocks in use after the drain (0),
server RSS growth from the end of calibration (< 2%), /health p99 per minute (< 250 ms); and
printed per minute: p99 TTFT per tier, the server's full GC pauses, its RSS.

RSS growth is counted net of the KV pools' resident pages (the server's
`everystop:kv_pool_resident_bytes`, mincore over the pool tensors): the pools are allocated
untouched, so a block's pages become resident the first time it is used, which is bounded by
the pool's size and is not growth; a calibration cannot be made to touch every block (the
allocator picks them, and the host pool is only written by swap-outs). Raw growth and the pools'
share are in the JSON too. The judged start point is the first scrape --warmup-minutes into the
mixed traffic (calibration sends no streams, disconnects, slow readers, bad bodies or tenants).

What grows (traced with smaps, mallinfo2/malloc_info and tracemalloc, stop 28): libtorch's code
pages (+9 MiB, first ~100 s, then flat); free chunks kept in per-thread malloc arenas (now
returned by the server's heap trimmer); and malloc'd memory in use, outside Python's objects
(tracemalloc: ~9 MiB of the growth). An engine alone (no server), 24 random-token prompts a
round: the same set three times +49, +19, 0 MiB in use; four new sets +63, +43, +33, +2; the
first set again +30. So it follows content/shapes not seen lately, like a bounded cache
filling, not a per-request leak. Attributed: oneDNN's two caches of compiled GEMMs,
one primitive per batch row count and weight shape (~0.4 MiB each, 1,024 entries per cache by
default, both must be bounded); the engine now bounds them at start-up
(executor/onednn_caches.py, --onednn-cache-capacity, default 64).

    everystop bench soak --minutes 20 --out soak.json

Not under `nice -n 19` on a shared host: the niced server then waits behind any other job, and
/health measures the host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import httpx

from everystop.bench.servers import everystop_server
from everystop.results import write_result
from everystop.stats import percentile

ADMIN_KEY = "soak-admin"
BAD_BODIES: list[tuple[bytes, str]] = [
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json"),
    (b'{"prompt": "a", "temperature": NaN}', "application/json"),
    (b'{"prompt": "\\ud800x"}', "application/json"),
    (b'{"prompt": "a", "max_tokens": 99999999999999999999999}', "application/json"),
    (b'{"prompt": "a"}', "text/plain"),
    (b'{"prompt": ["a", "b"], "n": 200}', "application/json"),
    (b'{"prompt": ', "application/json"),
    (b'{"prompt": ""}', "application/json"),
]
RSS_GROWTH_DEFINITION = (
    "judged rss_growth_pct: (RSS - KV pools' resident bytes) at the end, after the drain, minus "
    "the same at the first scrape {warmup} min or more into the mixed traffic (the declared "
    "warm-up: the first streams, disconnects, slow readers, bad bodies, tenants and reload), "
    "over the RSS then. Beside it: raw growth (pools included) and net growth, both from the "
    "end of calibration.")
WORDS = "ships harbour wind sail night stars map captain storm island rope sea".split()


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _metric(text: str, name: str, label: str = "") -> float:
    """The first sample of `name` whose labels contain `label` (e.g. 'generation="2"')."""
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")) and label in line:
            return float(line.rsplit(" ", 1)[1])  # every series has a model_name label
    return float("nan")


def _server_state(url: str) -> dict[str, float]:
    """RSS, the KV pools' resident bytes and the full-collection pauses so far, from one scrape."""
    text = httpx.get(url + "/metrics", timeout=30).text
    gen2 = 'generation="2"'
    return {"rss": _metric(text, "everystop:process_resident_memory_bytes"),
            "kv_pool_resident": _metric(text, "everystop:kv_pool_resident_bytes"),
            "gc_full_pauses": _metric(text, "everystop:gc_pause_seconds_count", gen2),
            "gc_full_pause_s": _metric(text, "everystop:gc_pause_seconds_sum", gen2),
            "gc_full_pauses_under_100ms": _metric(text, "everystop:gc_pause_seconds_bucket",
                                                  gen2 + ',le="0.1"'),
            "heap_trim_calls": _metric(text, "everystop:heap_trim_calls_total"),
            "heap_trim_released": _metric(text, "everystop:heap_trim_released_bytes_total"),
            "heap_trim_s": _metric(text, "everystop:heap_trim_seconds_total")}


class Soak:
    def __init__(self, url: str, args: argparse.Namespace, model: str) -> None:
        self.url, self.args, self.model = url, args, model
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []  # one per finished client
        self.health: list[tuple[float, float]] = []  # (at, latency)
        self.load: list[tuple[float, float]] = []  # (at, 1-minute load average): a shared host
        self.reloads: list[tuple[float, int]] = []
        self.server: list[tuple[float, dict[str, float]]] = []  # (at, _server_state)

    def minute(self, at: float) -> int:
        return int((at - self.t0) // 60)

    def body(self, stream: bool = True) -> dict[str, Any]:
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(4, 40)))
        return {"model": self.model, "prompt": f"Tell me about {words}.",
                "max_tokens": self.rng.randint(8, self.args.max_tokens), "stream": stream,
                "priority": self.rng.choice((0, 1, 1, 2)), "ignore_eos": True}

    async def one(self, http: httpx.AsyncClient, kind: str) -> None:
        start = time.monotonic()
        ev: dict[str, Any] = {"kind": kind, "at": start, "status": None, "ttft": None}
        try:
            if kind == "bad":
                raw, ctype = self.rng.choice(BAD_BODIES)
                r = await http.post("/v1/completions", content=raw,
                                    headers={"content-type": ctype})
                ev["status"] = r.status_code
                return
            body = self.body()
            ev["tier"] = body["priority"]
            tenant = {"X-Tenant-Id": f"tenant-{self.rng.randrange(8)}"}
            leave_after = self.rng.randint(1, 5) if kind == "disconnect" else None
            async with http.stream("POST", "/v1/completions", json=body,
                                   headers=tenant) as r:
                ev["status"] = r.status_code
                chunks = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if '"error"' in line[:20]:
                        ev["stream_error"] = line[:200]
                    chunks += 1
                    if chunks == 1:
                        ev["ttft"] = time.monotonic() - start
                        if kind == "slow":
                            await asyncio.sleep(self.args.slow_reader_timeout * 2 + 2)
                            return
                    if leave_after is not None and chunks >= leave_after:
                        return
        except httpx.HTTPError as exc:
            ev["transport_error"] = type(exc).__name__
        finally:
            ev["end"] = time.monotonic()
            self.events.append(ev)

    async def scheduled(self, http: httpx.AsyncClient, arrivals: list[tuple[float, str]]
                        ) -> None:
        extra = []
        for at, kind in arrivals:
            await asyncio.sleep(max(0.0, self.t0 + at - time.monotonic()))
            extra.append(asyncio.ensure_future(self.one(http, kind)))
        await asyncio.gather(*extra)

    async def probe(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            while not stop.is_set():
                t = time.monotonic()
                await http.get("/health")
                self.health.append((t, time.monotonic() - t))
                if len(self.health) % 50 == 0:
                    self.load.append((t, os.getloadavg()[0]))
                await asyncio.sleep(0.1)

    async def watch(self, stop: asyncio.Event) -> None:
        """The server's own state every --watch-s (a scrape, as Prometheus would make)."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.args.watch_s)
            state = await asyncio.to_thread(_server_state, self.url)
            self.server.append((time.monotonic(), state))

    async def reload(self, stop: asyncio.Event) -> None:
        seqs = self.args.max_num_seqs
        async with httpx.AsyncClient(base_url=self.url, timeout=30,
                                     headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as http:
            i = 0
            while not stop.is_set():
                with_timeout = asyncio.wait_for(stop.wait(), 60)
                try:
                    await with_timeout
                    return
                except TimeoutError:
                    pass
                i += 1
                value = seqs if i % 2 == 0 else max(1, seqs - 2)
                r = await http.patch("/admin/scheduler_config", json={"max_num_seqs": value})
                self.reloads.append((time.monotonic() - self.t0, r.status_code))

    async def calibrate(self) -> float:
        """Completed requests per second with --max-num-seqs closed-loop clients."""
        done = 0
        deadline = time.monotonic() + self.args.calibrate_s
        async with httpx.AsyncClient(base_url=self.url, timeout=300) as http:
            async def client() -> None:
                nonlocal done
                while time.monotonic() < deadline:
                    r = await http.post("/v1/completions", json=self.body(stream=False))
                    done += r.status_code == 200
            await asyncio.gather(*(client() for _ in range(self.args.max_num_seqs)))
        return done / self.args.calibrate_s

    async def run(self, rate: float) -> None:
        a = self.args
        stop = asyncio.Event()
        side = [asyncio.ensure_future(self.probe(stop)), asyncio.ensure_future(self.reload(stop)),
                asyncio.ensure_future(self.watch(stop))]
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        tasks = []
        async with httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits) as http:
            end = self.t0 + a.minutes * 60
            # At 2% and 1% a short run may see no hostile client at all: --min-each of every
            # kind arrive at random moments on top of the Poisson stream.
            extra = sorted((self.rng.uniform(0, a.minutes * 60), kind) for kind in
                           ("bad", "slow", "disconnect") for _ in range(a.min_each))
            tasks.append(asyncio.ensure_future(self.scheduled(http, extra)))
            while time.monotonic() < end:
                await asyncio.sleep(self.rng.expovariate(rate))
                u = self.rng.random()
                kind = ("bad" if u < a.bad else "slow" if u < a.bad + a.slow else
                        "disconnect" if u < a.bad + a.slow + a.disconnect else "valid")
                tasks.append(asyncio.ensure_future(self.one(http, kind)))
            await asyncio.gather(*tasks)
        stop.set()
        await asyncio.gather(*side)


def report(s: Soak, rate: float, capacity: float, state: tuple[dict[str, float], dict[str, float]],
           metrics: str, args: argparse.Namespace, uptime: tuple[str, str]) -> dict[str, Any]:
    minutes = _per_minute(s, state[0])
    valid = [e for e in s.events if e["kind"] != "bad"]
    bad = [e for e in s.events if e["kind"] == "bad"]
    kinds: dict[str, int] = defaultdict(int)
    for e in s.events:
        kinds[e["kind"]] += 1
    five_xx_valid = sum(1 for e in valid if (e["status"] or 0) >= 500)
    bad_not_4xx = sum(1 for e in bad if not 400 <= (e["status"] or 0) < 500)
    leaked = _metric(metrics, "everystop:kv_cache_used_blocks")
    worst_health = max((m["health_p99_ms"] for m in minutes), default=float("nan"))
    memory, rss_growth = _memory_checks(s, state, args.warmup_minutes)
    return {
        "benchmark": "soak", "minutes": args.minutes, "capacity_req_s": round(capacity, 3),
        "load": args.load, "rate_req_s": round(rate, 3), "arrivals": dict(kinds),
        "status_counts": {str(k): v for k, v in sorted(_counts(s.events).items())},
        "stream_errors": sum(1 for e in s.events if "stream_error" in e),
        "transport_errors": sum(1 for e in s.events if "transport_error" in e),
        "reloads": s.reloads, "per_minute": minutes,
        "checks": {"valid_5xx": five_xx_valid, "bad_input_not_4xx": bad_not_4xx,
                   "kv_blocks_in_use_after_drain": leaked, **memory,
                   "worst_minute_health_p99_ms": worst_health},
        "passed": {"no_5xx": five_xx_valid == 0, "bad_input_4xx": bad_not_4xx == 0,
                   "no_leaked_blocks": leaked == 0,
                   "rss_growth_under_2pct": rss_growth < 2,
                   "health_p99_under_250ms": worst_health < 250},
        "server_flags": args.server_flags,
        "uptime_start_end": list(uptime),
    }


def _per_minute(s: Soak, start: dict[str, float]) -> list[dict[str, Any]]:
    """One row per minute of the mixed traffic (also printed as it is made): arrivals, /health
    and TTFT p99 per tier, the load average, full GC pauses and the RSS net of the KV pools."""
    per_minute: dict[int, dict[str, Any]] = defaultdict(lambda: defaultdict(list))
    for ev in s.events:
        m = per_minute[s.minute(ev["at"])]
        m["arrivals"].append(ev["kind"])
        if ev["kind"] == "valid" and ev["ttft"] is not None:
            m[f"ttft_tier{ev['tier']}"].append(ev["ttft"])
    for at, lat in s.health:
        per_minute[s.minute(at)]["health"].append(lat)
    for at, load in s.load:
        per_minute[s.minute(at)]["load"].append(load)
    previous = start
    for at, now in s.server:  # per minute: pauses since the previous scrape, the last RSS
        m = per_minute[s.minute(at)]
        m["gc_full_pauses"].append(now["gc_full_pauses"] - previous["gc_full_pauses"])
        m["gc_full_pause_s"].append(now["gc_full_pause_s"] - previous["gc_full_pause_s"])
        m["rss_net_mib"] = [(now["rss"] - now["kv_pool_resident"]) / 2**20]
        previous = now
    minutes = []
    for i in sorted(per_minute):
        m = per_minute[i]
        row: dict[str, Any] = {"minute": i, "arrivals": len(m["arrivals"]),
                               "health_p99_ms": round(1e3 * percentile(m["health"], 99,
                                                                        empty=0.0), 1),
                               "health_max_ms": round(1e3 * max(m["health"], default=0.0), 1),
                               "load_avg_1m_max": max(m["load"], default=None),
                               "gc_full_pauses": int(sum(m["gc_full_pauses"])),
                               "gc_full_pause_ms": round(1e3 * sum(m["gc_full_pause_s"]), 1),
                               "rss_net_of_kv_pool_mib": round(m["rss_net_mib"][0], 1)
                               if m["rss_net_mib"] else None}
        for tier in range(3):
            p99 = percentile(m[f"ttft_tier{tier}"], 99)
            row[f"ttft_p99_s_tier{tier}"] = None if p99 is None else round(p99, 3)
        minutes.append(row)
        print(json.dumps(row), file=sys.stderr)
    return minutes


def _memory_checks(s: Soak, state: tuple[dict[str, float], dict[str, float]],
                   warmup_minutes: float) -> tuple[dict[str, Any], float]:
    """RSS growth (judged, raw and from calibration), the heap trims and the full GC pauses;
    and the judged growth in percent, unrounded."""
    start, end = state
    raw_growth = (end["rss"] - start["rss"]) / start["rss"] * 100
    pool_growth = end["kv_pool_resident"] - start["kv_pool_resident"]
    from_calibration = (end["rss"] - start["rss"] - pool_growth) / start["rss"] * 100
    warm = _warm_state(s, warmup_minutes * 60) or start
    # Judged: net of the pools, from the end of the declared warm-up to the drained end.
    rss_growth = ((end["rss"] - end["kv_pool_resident"]) - (warm["rss"] - warm["kv_pool_resident"])
                  ) / warm["rss"] * 100
    checks = {"rss_bytes_start_end": [start["rss"], end["rss"]],
              "kv_pool_resident_bytes_start_end": [start["kv_pool_resident"],
                                                   end["kv_pool_resident"]],
              "rss_growth_definition": RSS_GROWTH_DEFINITION.format(warmup=warmup_minutes),
              "rss_bytes_at_warmup_end": warm["rss"],
              "kv_pool_resident_bytes_at_warmup_end": warm["kv_pool_resident"],
              "rss_growth_pct": round(rss_growth, 2),
              "rss_growth_raw_pct": round(raw_growth, 2),
              "rss_growth_net_of_kv_pool_from_calibration_pct": round(from_calibration, 2),
              "heap_trim_calls_released_mib_seconds": [
                  end["heap_trim_calls"], round(end["heap_trim_released"] / 2**20, 1),
                  round(end["heap_trim_s"], 3)],
              "gc_full_pauses_total": end["gc_full_pauses"] - start["gc_full_pauses"],
              "gc_full_pauses_over_100ms": (end["gc_full_pauses"]
                                            - end["gc_full_pauses_under_100ms"]
                                            - start["gc_full_pauses"]
                                            + start["gc_full_pauses_under_100ms"])}
    return checks, rss_growth


def _warm_state(s: Soak, after_s: float) -> dict[str, float] | None:
    """The server's state at the first scrape `after_s` or more into the mixed traffic."""
    return next((state for at, state in s.server if at - s.t0 >= after_s), None)


def _counts(events: list[dict[str, Any]]) -> dict[Any, int]:
    out: dict[Any, int] = defaultdict(int)
    for e in events:
        out[e["status"]] += 1
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--load", type=float, default=0.8, help="fraction of measured capacity")
    ap.add_argument("--rate", type=float, default=None, help="arrivals/s (skips calibration)")
    ap.add_argument("--calibrate-s", type=float, default=60.0)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--bad", type=float, default=0.02)
    ap.add_argument("--slow", type=float, default=0.01)
    ap.add_argument("--disconnect", type=float, default=0.10)
    ap.add_argument("--min-each", type=int, default=3,
                    help="at least this many bad, slow and disconnecting clients")
    ap.add_argument("--slow-reader-timeout", type=float, default=10.0)
    ap.add_argument("--watch-s", type=float, default=20.0,
                    help="seconds between scrapes of the server's RSS and GC pauses")
    ap.add_argument("--warmup-minutes", type=float, default=1.0,
                    help="minutes of the mixed traffic before the judged RSS start point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    args.server_flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512",
                         "--max-num-batched-tokens", "256", "--kv-cache-memory", "128MiB",
                         "--admin-key", ADMIN_KEY, "--slow-reader-timeout",
                         str(args.slow_reader_timeout), "--log-level", "warning"]
    with everystop_server(args.server_flags) as (_, url):
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        soak = Soak(url, args, model)
        capacity = args.rate / args.load if args.rate else asyncio.run(soak.calibrate())
        rate = args.rate or capacity * args.load
        uptime_start = _uptime()
        state_start = _server_state(url)
        soak.t0 = time.monotonic()
        asyncio.run(soak.run(rate))
        for _ in range(100):  # the drain: everything finished or aborted
            metrics = httpx.get(url + "/metrics", timeout=10).text
            if _metric(metrics, "everystop:num_requests_running") == 0 and \
                    _metric(metrics, "everystop:kv_cache_used_blocks") == 0:
                break
            time.sleep(0.2)
        state_end = _server_state(url)
        write_result(report(soak, rate, capacity, (state_start, state_end), metrics, args,
                            (uptime_start, _uptime())), args.out)
    return 0
