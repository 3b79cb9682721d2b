"""Routing policies side by side: `everystop serve --replicas 2` (one thread per replica) under
the same workloads, one server start per policy, everything else equal.

Two workloads (prompts are token ids cut from a fixed English corpus, sent as-is):
  skewed         a few 1,500-token prompts with long outputs mixed into many short chats,
                 Poisson arrivals at --load x the capacity measured first (all-at-once run);
                 every policy: p50/p99 TTFT (all requests, and short and long prompts apart),
                 output tok/s.
  shared-prefix  every prompt starts with one of --groups system prompts; the replicas' KV
                 pools hold only about half of them, so where a prefix lands decides whether it
                 is still cached; least-loaded vs prefix-affinity: prefix-cache hit rate.

    everystop bench routing --out benchmarks/results/routing_policies.json
    everystop bench routing --dtype bfloat16 --server-flag=--cpu-kernels=auto ...

`--dtype` and `--server-flag` go to every cluster's `everystop serve`, after the workload's own
limits (so they win where they repeat one), and into the JSON's `server_flags`.

Targets: skewed: least-loaded p99 TTFT <= 0.7x round-robin's and <= power-of-two's,
output tok/s not lower; shared-prefix: prefix-affinity's hit rate >= 1.5x least-loaded's at
equal or better p99 TTFT. The JSON's `verdict` computes each from this run. The skewed default
is 4 long prompts in 404 (1%: "a few among many"), where the p99 is a short request's and so
routing's to move. With 4 long in 96 (`--requests 96 --long 4`, 4.2%) the p99 is the
second-slowest long prompt's TTFT, bounded below by its own prefill wherever it goes: out of
routing's reach (docs/scale-out.md, "The arithmetic"); the verdict flags such runs
(`p99_rests_on_long_prompts`).

The machine may be shared: the JSON records the load average before and after every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from everystop.bench.routing_sim import add_sim_arguments, simulate_all
from everystop.bench.servers import child_env, wait_healthy
from everystop.results import write_result
from everystop.routing import POLICIES
from everystop.workload import Workload, WorkloadRequest, english_corpus

LONG_PROMPT, LONG_OUTPUT = 1500, 192


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """One `everystop serve --replicas 2` subprocess; stopping it takes its Ray along."""

    def __init__(self, policy: str, flags: list[str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        # The serving process imports this very package (the tree under test, not an install).
        src = str(Path(__file__).resolve().parents[2])
        env = child_env(src, inherit_python_path=True, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "everystop", "serve", "--replicas", "2", "--threads", "1",
               "--routing-policy", policy, "--log-level", "warning",
               "--port", self.url.rsplit(":", 1)[1], *flags]
        self._log = open(log, "wb")  # noqa: SIM115 - written until stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        try:
            wait_healthy(self.proc, self.url, f"server not ready; see {log}")
            while len(self._replicas()) < 2:  # /health is up with one replica reporting
                if time.monotonic() - t0 > 300:
                    raise SystemExit(f"two replicas not reporting; see {log}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0

    def _replicas(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/health/replicas", timeout=5).json()["replicas"])

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("everystop_"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        """SIGINT the server (it shuts its Ray instance down), then kill whatever of its own
        process tree is left: only processes it started."""
        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
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
    from everystop.tokenizer import load_tokenizer
    return list(load_tokenizer().encode(english_corpus()))


def _cut(tokens: list[int], rng: random.Random, n: int) -> list[int]:
    start = rng.randrange(0, len(tokens) - n)
    return tokens[start:start + n]


def skewed(tokens: list[int], n: int, num_long: int, seed: int) -> tuple[Workload, dict]:
    """`num_long` 1,500-token prompts (192 output tokens) at random places among short chats."""
    rng = random.Random(seed)
    long_at = set(rng.sample(range(n), num_long))
    reqs, ids = [], {}
    for i in range(n):
        plen, out = ((LONG_PROMPT, LONG_OUTPUT) if i in long_at
                     else (rng.randint(24, 96), rng.randint(16, 48)))
        rid = f"r{i}"
        ids[rid] = _cut(tokens, rng, plen)
        reqs.append(WorkloadRequest(rid, "", plen, out, tenant=f"t{i}"))
    spec = {"kind": "skewed", "n": n,
            "long": {"count": num_long, "prompt": LONG_PROMPT, "output": LONG_OUTPUT},
            "short": {"prompt": "uniform 24..96", "output": "uniform 16..48"}, "seed": seed}
    return Workload(f"skewed-{n}", seed, spec, reqs), ids


def shared_prefix(tokens: list[int], n: int, groups: int, prefix_len: int,
                  seed: int) -> tuple[Workload, dict]:
    """Every prompt: one of `groups` system prompts, then its own 16..48 tokens."""
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


def _by_replica(series: dict[str, float]) -> dict[str, float]:
    """{'name{replica="a",...}': v} -> {"a": v}, summed over the other labels."""
    out: dict[str, float] = {}
    for k, v in series.items():
        rid = k.split('replica="')[1].split('"')[0]
        out[rid] = out.get(rid, 0.0) + v
    return out


def measure(cluster: Cluster, workload: Workload, ids: dict, rate: float) -> dict[str, Any]:
    load_before = os.getloadavg()
    before = cluster.metrics()
    report = _replay(cluster, workload, ids, rate)
    after = cluster.metrics()
    s = report["summary"]
    hits_by = _by_replica(_delta(after, before, "everystop_replica_prefix_cache_hits_total"))
    queries_by = _by_replica(_delta(after, before,
                                    "everystop_replica_prefix_cache_queries_total"))
    hits, queries = sum(hits_by.values()), sum(queries_by.values())
    rows = [r for r in report["requests"] if r["success"]]
    # Short prompts' TTFT is what routing changes most: a long prompt's own TTFT is mostly its
    # own prefill, wherever it goes.
    short = distribution_ms([r["ttft_s"] for r in rows if r["prompt_len"] < 1000])
    longs = distribution_ms([r["ttft_s"] for r in rows if r["prompt_len"] >= 1000])
    return {"rate_req_s": rate, "completed": s["completed"], "failed": s["failed"],
            "duration_s": s["duration_s"], "output_tok_s": s["output_throughput"],
            "ttft_ms": {k: s["ttft_ms"][k] for k in ("p50", "p90", "p99", "mean")},
            "ttft_ms_short_prompts": short, "ttft_ms_long_prompts": longs,
            "prefix_cache": {"hit_tokens": hits, "query_tokens": queries,
                             "hit_rate": hits / queries if queries else 0.0,
                             # A replica holding more prefixes than its pool keeps shows here.
                             "hit_rate_per_replica": {
                                 rid: hits_by.get(rid, 0.0) / q
                                 for rid, q in queries_by.items() if q}},
            "routed": _by_replica(_delta(after, before, "everystop_router_requests_total")),
            "retries": _delta(after, before, "everystop_router_retries_total"),
            # Why the router chose as it did (prefix-affinity: affinity, margin, kv_tier, ...).
            "decisions": {k.split('reason="')[1].split('"')[0]: v for k, v in
                          _delta(after, before, "everystop_router_decisions_total").items()},
            "kv_blocks_per_replica": {k.split('replica="')[1].split('"')[0]: v for k, v in
                                      after.items()
                                      if k.startswith("everystop_replica_kv_cache_total_blocks")},
            # Each request's TTFT (ms, by id): which requests a p99 of few samples rests on.
            "ttft_ms_by_request": {r["id"]: round(1000 * r["ttft_s"], 1) for r in rows},
            "load_avg_before": list(load_before), "load_avg_after": list(os.getloadavg())}


def run_workload(name: str, workload: Workload, ids: dict, calib: tuple[Workload, dict],
                 policies: list[str], flags: list[str], load: float, rate: float | None,
                 logs: Path, save: Any, done: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each policy on its own fresh cluster, the same arrivals at the same rate. `save(out)`
    after each policy: a run cut short by its time limit keeps the policies it finished, and
    `done` (that saved part) resumes it: its policies are skipped, its arrival rate reused."""
    out: dict[str, Any] = {"workload": workload.spec, "server_flags": flags, "policies": {}}
    if done and done.get("workload") == workload.spec and done.get("server_flags") == flags:
        out = done
        rate = rate if rate is not None else next(
            (p["rate_req_s"] for p in done["policies"].values()), None)
    if rate is not None and "capacity" not in out:
        out["capacity"] = {"given_rate_req_s": rate}
    todo = [p for p in policies if p not in out["policies"]]
    if rate is None and todo:
        # Capacity: the calibration workload all at once, on a cluster of its own. NOTE: not
        # on the first policy's cluster: a 100-request burst leaves its engines' step-cost
        # models and caches warm, and that policy alone would be measured on a used cluster.
        cluster = Cluster(todo[0], flags, logs / f"{name}-calibration.log")
        try:
            t = _replay(cluster, calib[0], calib[1], math.inf)["summary"]
        finally:
            cluster.stop()
        rate = load * t["request_throughput"]
        out["capacity"] = {"req_s": t["request_throughput"], "output_tok_s": t["output_throughput"],
                           "measured_with": todo[0], "load_fraction": load}
    for policy in todo:
        cluster = Cluster(policy, flags, logs / f"{name}-{policy}.log")
        try:
            result = measure(cluster, workload, ids, rate)
            result["server_start_s"] = cluster.start_s
            out["policies"][policy] = result
            save(out)
            print(f"{name} {policy}: ttft {result['ttft_ms']} short p99 "
                  f"{result['ttft_ms_short_prompts']['p99']:.0f} "
                  f"{result['output_tok_s']:.1f} tok/s hit "
                  f"{result['prefix_cache']['hit_rate']:.2f} routed {result['routed']} "
                  f"decisions {result['decisions']} load {os.getloadavg()}", flush=True)
        finally:
            cluster.stop()
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, computed from this run's numbers only."""
    out: dict[str, Any] = {}
    pol = result.get("skewed", {}).get("policies", {})
    if {"least-loaded", "round-robin", "power-of-two"} <= pol.keys():
        ll, rr, p2 = pol["least-loaded"], pol["round-robin"], pol["power-of-two"]
        out["skewed"] = {
            "p99_ttft_ll_over_rr": _ratio(ll["ttft_ms"]["p99"], rr["ttft_ms"]["p99"]),
            "p99_ttft_ll_over_p2": _ratio(ll["ttft_ms"]["p99"], p2["ttft_ms"]["p99"]),
            "short_p99_ttft_ll_over_rr": _ratio(ll["ttft_ms_short_prompts"]["p99"],
                                                rr["ttft_ms_short_prompts"]["p99"]),
            "long_p99_ttft_ll_over_rr": _ratio(ll["ttft_ms_long_prompts"]["p99"],
                                               rr["ttft_ms_long_prompts"]["p99"]),
            "output_tok_s_ll_over_rr": _ratio(ll["output_tok_s"], rr["output_tok_s"])}
        v = out["skewed"]
        spec = result["skewed"].get("workload")
        if spec:
            # np.percentile's linear p99 lies between sorted samples floor(0.99 (n-1)) and the
            # next. The long prompts have the largest TTFTs; when that lower sample is one of
            # them, the p99 is a long prompt's TTFT, mostly its own prefill wherever it goes
            # (docs/scale-out.md, "The arithmetic").
            n, num_long = spec["n"], spec["long"]["count"]
            v["p99_rests_on_long_prompts"] = math.floor(0.99 * (n - 1)) >= n - num_long
        v["target_met"] = bool(v["p99_ttft_ll_over_rr"] <= 0.7 and v["p99_ttft_ll_over_p2"] <= 1.0
                               and v["output_tok_s_ll_over_rr"] >= 0.97)
    pol = result.get("shared_prefix", {}).get("policies", {})
    if {"least-loaded", "prefix-affinity"} <= pol.keys():
        ll, pa = pol["least-loaded"], pol["prefix-affinity"]
        out["shared_prefix"] = {
            "hit_rate_pa_over_ll": _ratio(pa["prefix_cache"]["hit_rate"],
                                          ll["prefix_cache"]["hit_rate"]),
            "p99_ttft_pa_over_ll": _ratio(pa["ttft_ms"]["p99"], ll["ttft_ms"]["p99"])}
        v = out["shared_prefix"]
        v["target_met"] = bool(v["hit_rate_pa_over_ll"] >= 1.5 and v["p99_ttft_pa_over_ll"] <= 1.0)
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=None)
    ap.add_argument("--workloads", default="skewed,shared-prefix")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="skewed workload's policies (shared-prefix: least-loaded and "
                         "prefix-affinity of these)")
    ap.add_argument("--requests", type=int, default=404, help="skewed: requests in all")
    ap.add_argument("--long", type=int, default=4,
                    help="skewed: 1,500-token prompts among them (default 1%%)")
    ap.add_argument("--prefix-requests", type=int, default=96, help="shared-prefix: requests")
    ap.add_argument("--groups", type=int, default=8, help="shared-prefix: system prompts")
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--load", type=float, default=0.8, help="arrival rate / measured capacity")
    ap.add_argument("--rate", type=float, default=None,
                    help="skewed arrival rate (req/s) instead of measuring capacity first")
    ap.add_argument("--prefix-rate", type=float, default=None,
                    help="shared-prefix arrival rate (req/s) instead of measuring capacity")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="the replicas' --dtype (default: serve's)")
    ap.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                    help="one more `everystop serve` argument for every cluster, repeatable; "
                         "write flags with their value as --server-flag=--name=value. Recorded "
                         "in the JSON's server_flags")
    ap.add_argument("--logs", default="/tmp/everystop-routing-bench")
    ap.add_argument("--resume", action="store_true",
                    help="continue the --out file of a run cut short: skip the policies it "
                         "has, at its arrival rate (one file, several CPU-lock slots)")
    add_sim_arguments(ap)


# Each workload's replica limits (the simulator's `_simulate` mirrors them).
WORKLOAD_FLAGS = {
    "skewed": ["--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--max-num-seqs", "16",
               "--max-num-batched-tokens", "512"],
    # 160 blocks x 16 = 2,560 tokens of KV per replica: fewer than the 8 system prompts' 3,072
    # tokens (plus the running work), so a replica seeing every prefix keeps evicting some.
    "shared-prefix": ["--max-model-len", "1024", "--num-gpu-blocks", "160", "--max-num-seqs", "8",
                      "--max-num-batched-tokens", "512"],
}


def server_flags(workload: str, args: argparse.Namespace) -> list[str]:
    """`everystop serve` flags for one workload: its replica limits, then the caller's
    (`--dtype`, `--server-flag`), which come last so that they win where they repeat one."""
    extra = ["--dtype", args.dtype] if args.dtype else []
    return [*WORKLOAD_FLAGS[workload], *extra, *args.server_flag]


def run(args: argparse.Namespace) -> int:
    # `timeout` ends a run with SIGTERM: exit through the `finally`s, which stop the servers
    # and their Ray processes, instead of leaving them running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    tokens = _tokens()
    if args.simulate:
        return _simulate(tokens, args, policies)
    result: dict[str, Any] = {
        "benchmark": "routing_policies", "replicas": 2, "threads_per_replica": 1,
        "note": "machine possibly shared with other jobs: compare policies within this file "
                "only (load averages recorded per run)",
        "load_avg_start": list(os.getloadavg())}
    wanted = args.workloads.split(",")
    if args.resume:
        if not args.out or not Path(args.out).exists():
            raise SystemExit("--resume continues the --out file of an earlier run: give it")
        earlier = json.loads(Path(args.out).read_text())
        for key in ("skewed", "shared_prefix"):
            if key in earlier:
                result[key] = earlier[key]
        result["load_avg_start_earlier"] = earlier.get("load_avg_start")

    def saver(key: str) -> Any:
        def save(partial: dict[str, Any]) -> None:
            result[key] = partial
            if args.out:
                write_result({**result, "partial": True}, args.out, quiet=True)
        return save

    if "skewed" in wanted:
        result["skewed"] = run_workload(
            "skewed", *skewed(tokens, args.requests, args.long, seed=1),
            calib=skewed(tokens, args.requests, args.long, seed=2), policies=policies,
            flags=server_flags("skewed", args), load=args.load, rate=args.rate, logs=logs,
            save=saver("skewed"), done=result.get("skewed"))
    if "shared-prefix" in wanted:
        flags = server_flags("shared-prefix", args)
        wl = shared_prefix(tokens, args.prefix_requests, args.groups, args.prefix_len, seed=1)
        result["shared_prefix"] = run_workload(
            "shared", *wl,
            calib=shared_prefix(tokens, args.prefix_requests, args.groups, args.prefix_len,
                                seed=2),
            policies=[p for p in policies if p in ("least-loaded", "prefix-affinity")],
            flags=flags, load=args.load, rate=args.prefix_rate, logs=logs,
            save=saver("shared_prefix"), done=result.get("shared_prefix"))
    result["load_avg_end"] = list(os.getloadavg())
    result["verdict"] = verdict(result)
    write_result(result, args.out)
    return 0


def _simulate(tokens: list[int], args: argparse.Namespace, policies: list[str]) -> int:
    """The same workloads and per-replica limits as the live run, in the fleet simulator."""
    wanted = args.workloads.split(",")
    workloads: dict[str, Any] = {}
    if "skewed" in wanted:
        # 128 MiB of KV for the default model: 341 blocks of 16 tokens per replica.
        workloads["skewed"] = (lambda seed: skewed(tokens, args.requests, args.long, seed),
                               {"max_num_seqs": 16, "max_num_batched_tokens": 512,
                                "num_gpu_blocks": 341})
    if "shared-prefix" in wanted:
        workloads["shared_prefix"] = (
            lambda seed: shared_prefix(tokens, args.prefix_requests, args.groups,
                                       args.prefix_len, seed),
            {"max_num_seqs": 8, "max_num_batched_tokens": 512, "num_gpu_blocks": 160})
    result = {"benchmark": "routing_policies_simulated", "replicas": 2,
              "workload_args": {"requests": args.requests, "long": args.long,
                                "prefix_requests": args.prefix_requests, "groups": args.groups,
                                "prefix_len": args.prefix_len},
              **simulate_all(tokens, args, policies, workloads)}
    write_result(result, args.out)
    return 0
