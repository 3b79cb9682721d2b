"""Routing policies side by side: `everystop serve --replicas 2` (one thread per replica) under
the same workloads, one server start per policy, everything else equal.

Two workloads (prompts are token ids cut from a fixed English corpus, sent as-is):
  skewed         a few 1,500-token prompts with long outputs mixed into many short chats,
                 Poisson arrivals at --load x the capacity measured first (all-at-once run);
                 every policy: p50/p99 TTFT, output tok/s.
  shared-prefix  every prompt starts with one of --groups system prompts; the replicas' KV
                 pools hold only about half of them, so where a prefix lands decides whether it
                 is still cached; least-loaded vs prefix-affinity: prefix-cache hit rate.

    PYTHONPATH=src python benchmarks/routing_bench.py --out benchmarks/results/routing_policies.json

The machine is shared: the JSON records the load average before and after every run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from everystop.bench.client import ServeOptions, run_serve
from everystop.bench.metrics import distribution_ms
from everystop.results import write_result
from everystop.tokenizer import load_tokenizer
from everystop.workload import Workload, WorkloadRequest, english_corpus

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("least-loaded", "prefix-affinity", "power-of-two", "round-robin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """One `everystop serve --replicas 2` subprocess; stopping it takes its Ray along."""

    def __init__(self, policy: str, flags: list[str], log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "everystop", "serve", "--replicas", "2", "--threads", "1",
               "--routing-policy", policy, "--log-level", "warning", "--port", str(self.port),
               *flags]
        self._log = open(log, "wb")  # noqa: SIM115 - written until stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {log}")
            try:
                r = httpx.get(self.url + "/health/replicas", timeout=2)
                if r.status_code == 200 and len(r.json()["replicas"]) == 2:
                    self.start_s = time.monotonic() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready; see {log}")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("everystop_"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        family = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        _, alive = psutil.wait_procs(family, timeout=10)
        for p in alive:
            p.kill()
        self._log.close()


def _tokens() -> list[int]:
    return list(load_tokenizer().encode(english_corpus()))


def _cut(tokens: list[int], rng: random.Random, n: int) -> list[int]:
    start = rng.randrange(0, len(tokens) - n)
    return tokens[start:start + n]


def skewed(tokens: list[int], n: int, num_long: int, seed: int) -> tuple[Workload, dict]:
    rng = random.Random(seed)
    long_at = set(rng.sample(range(n), num_long))
    reqs, ids = [], {}
    for i in range(n):
        plen, out = (1500, 192) if i in long_at else (rng.randint(24, 96), rng.randint(16, 48))
        rid = f"r{i}"
        ids[rid] = _cut(tokens, rng, plen)
        reqs.append(WorkloadRequest(rid, "", plen, out, tenant=f"t{i}"))
    spec = {"kind": "skewed", "n": n, "long": {"count": num_long, "prompt": 1500, "output": 192},
            "short": {"prompt": "uniform 24..96", "output": "uniform 16..48"}, "seed": seed}
    return Workload(f"skewed-{n}", seed, spec, reqs), ids


def shared_prefix(tokens: list[int], n: int, groups: int, prefix_len: int,
                  seed: int) -> tuple[Workload, dict]:
    rng = random.Random(seed)
    prefixes = [_cut(tokens, rng, prefix_len) for _ in range(groups)]
    reqs, ids = [], {}
    for i in range(n):
        suffix = _cut(tokens, rng, rng.randint(16, 48))
        rid = f"s{i}"
        ids[rid] = prefixes[rng.randrange(groups)] + suffix
        reqs.append(WorkloadRequest(rid, "", len(ids[rid]), rng.randint(16, 32),
                                    tenant=f"t{i}"))
    spec = {"kind": "shared-prefix", "n": n, "groups": groups, "prefix_len": prefix_len,
            "suffix": "uniform 16..48", "output": "uniform 16..32", "seed": seed}
    return Workload(f"shared-prefix-{n}", seed, spec, reqs), ids


def _replay(cluster: Cluster, workload: Workload, ids: dict, rate: float) -> dict[str, Any]:
    opts = ServeOptions(base_url=cluster.url, rate=rate, seed=0, prompt_token_ids=ids,
                        progress=False, timeout_s=600)
    return asyncio.run(run_serve(workload, opts))


def _delta(after: dict[str, float], before: dict[str, float], prefix: str) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if k.startswith(prefix)}


def measure(cluster: Cluster, workload: Workload, ids: dict, rate: float) -> dict[str, Any]:
    load_before = os.getloadavg()
    before = cluster.metrics()
    report = _replay(cluster, workload, ids, rate)
    after = cluster.metrics()
    s = report["summary"]
    hits = sum(_delta(after, before, "everystop_replica_prefix_cache_hits_total").values())
    queries = sum(_delta(after, before, "everystop_replica_prefix_cache_queries_total").values())
    rows = [r for r in report["requests"] if r["success"]]
    # The short requests' TTFT is what routing can change: a long prompt's own TTFT is mostly
    # its own prefill, wherever it goes.
    short = distribution_ms([r["ttft_s"] for r in rows if r["prompt_len"] < 1000])
    longs = distribution_ms([r["ttft_s"] for r in rows if r["prompt_len"] >= 1000])
    return {"rate_req_s": rate, "completed": s["completed"], "failed": s["failed"],
            "duration_s": s["duration_s"], "output_tok_s": s["output_throughput"],
            "ttft_ms": {k: s["ttft_ms"][k] for k in ("p50", "p90", "p99", "mean")},
            "ttft_ms_short_prompts": short, "ttft_ms_long_prompts": longs,
            "prefix_cache": {"hit_tokens": hits, "query_tokens": queries,
                             "hit_rate": hits / queries if queries else 0.0},
            "routed": {k.split('replica="')[1].split('"')[0]: v for k, v in
                       _delta(after, before, "everystop_router_requests_total").items()},
            "retries": _delta(after, before, "everystop_router_retries_total"),
            "load_avg_before": list(load_before), "load_avg_after": list(os.getloadavg())}


def run_workload(name: str, workload: Workload, ids: dict, calib: tuple[Workload, dict],
                 policies: tuple[str, ...], flags: list[str], load: float,
                 logs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": workload.spec, "server_flags": flags, "policies": {}}
    rate = math.nan
    for policy in policies:
        cluster = Cluster(policy, flags, logs / f"{name}-{policy}.log")
        try:
            if math.isnan(rate):  # capacity: the calibration workload all at once
                t = _replay(cluster, calib[0], calib[1], math.inf)["summary"]
                capacity = t["request_throughput"]
                rate = load * capacity
                out["capacity"] = {"req_s": capacity, "output_tok_s": t["output_throughput"],
                                   "measured_with": policy, "load_fraction": load}
            result = measure(cluster, workload, ids, rate)
            result["server_start_s"] = cluster.start_s
            out["policies"][policy] = result
            print(f"{name} {policy}: {result['ttft_ms']} {result['output_tok_s']:.1f} tok/s "
                  f"hit {result['prefix_cache']['hit_rate']:.2f} load {os.getloadavg()}",
                  flush=True)
        finally:
            cluster.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--long", type=int, default=4, help="1,500-token prompts in the skewed mix")
    ap.add_argument("--load", type=float, default=0.8, help="arrival rate / measured capacity")
    ap.add_argument("--groups", type=int, default=8, help="system prompts (shared-prefix)")
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--workloads", default="skewed,shared-prefix")
    ap.add_argument("--logs", default="/tmp/everystop-routing-bench")
    args = ap.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    tokens = _tokens()
    result: dict[str, Any] = {
        "benchmark": "routing_policies", "replicas": 2, "threads_per_replica": 1,
        "note": "2-core machine shared with other jobs: absolute numbers are noisy; compare "
                "policies within this file only (load averages recorded per run)",
        "load_avg_start": list(os.getloadavg())}
    wanted = args.workloads.split(",")
    if "skewed" in wanted:
        flags = ["--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--max-num-seqs", "16",
                 "--max-num-batched-tokens", "512"]
        result["skewed"] = run_workload(
            "skewed", *skewed(tokens, args.requests, args.long, seed=1),
            calib=skewed(tokens, args.requests, args.long, seed=2), policies=POLICIES,
            flags=flags, load=args.load, logs=logs)
    if "shared-prefix" in wanted:
        # ~2,560 tokens of KV per replica: half the system prompts (plus running work) fit.
        flags = ["--max-model-len", "1024", "--num-gpu-blocks", "160", "--max-num-seqs", "8",
                 "--max-num-batched-tokens", "512"]
        result["shared_prefix"] = run_workload(
            "shared", *shared_prefix(tokens, args.requests, args.groups, args.prefix_len, seed=1),
            calib=shared_prefix(tokens, args.requests, args.groups, args.prefix_len, seed=2),
            policies=("least-loaded", "prefix-affinity"), flags=flags, load=args.load,
            logs=logs)
    result["load_avg_end"] = list(os.getloadavg())
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
