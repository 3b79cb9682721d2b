"""Every number in docs/fleet-simulation.md, regenerated: fleet runs of 4xH100 / Llama-3-70B
replicas (the fleet simulator: the real scheduler per replica, the production router), written to
JSON, plotted, and the markdown rendered from them.

    everystop bench fleet-report [--jobs N] [--quick]

  1. p99 TTFT vs offered load, each router policy, 16 replicas, the design's traffic shape
  2. multi-turn chats (each turn resends its history): prefix-cache hit rate per policy
  3. capacity plans for 50, 200 and 1,000 req/s (1 s p99 TTFT, 50 ms p50 TPOT)

Independent runs go to a process pool (`--jobs`, default: the CPU count). `--quick` shrinks
every run for a smoke test; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from everystop.results import cpu_info, write_result
from everystop.routing import POLICIES, make_router
from everystop.sim.fleet_metrics import summarize_fleet
from everystop.sim.fleet_report_md import ROOT, render
from everystop.sim.fleet_run import simulate_fleet
from everystop.sim.fleet_workload import fleet_traffic
from everystop.sim.node import build_node
from everystop.sim.plan import DESIGN_TRAFFIC, SLO, Planner, replica_price

OUT_JSON = ROOT / "benchmarks/results/sim/fleet_report.json"
DOC = ROOT / "docs/fleet-simulation.md"
IMG = ROOT / "docs/img"
MODEL, HARDWARE, TP, REPLICAS = "llama-3-70b", "h100-sxm", 4, 16
PER_REPLICA_RPS = [9.0, 11.0, 13.0]  # offered load, req/s per replica
CHAT = "prompt=uniform:64:512,output=uniform:20:400,sessions=0.8:4:10,prefix=0.5:512,tenants=8"
CHAT_POLICIES = ("prefix-affinity", "least-loaded", "round-robin")
CHAT_RPS_PER_REPLICA = 6.0
PLAN_RATES = [50.0, 200.0, 1000.0]
SLO_TTFT_P99_S, SLO_TPOT_P50_S = 1.0, 0.05
STATS_INTERVAL_S = 1.0
PLAN_DURATION_S = 6.0  # simulated seconds of arrivals per plan point
PLAN_GRID = (0.7, 0.8, 0.9, 1.0)  # replica counts tried, as fractions of the guess


def fleet_point(policy: str, traffic: str, rate: float, duration_s: float) -> dict:
    node = build_node(MODEL, HARDWARE, TP)
    spec = f"{traffic},n={max(200, round(rate * duration_s))},rate={rate},seed=0"
    t0 = time.process_time()
    result = simulate_fleet(fleet_traffic(spec, node.cost.model.max_model_len), node.setup,
                            node.cost.latency, REPLICAS, make_router(policy, seed=0),
                            stats_interval_s=STATS_INTERVAL_S)
    price, _ = replica_price(HARDWARE, TP, None)
    return {"policy": policy, "rate_rps": rate, "traffic": spec,
            "sim_cpu_s": round(time.process_time() - t0, 1), **summarize_fleet(result, price)}


def _planner() -> Planner:
    node = build_node(MODEL, HARDWARE, TP)
    price, _ = replica_price(HARDWARE, TP, None)
    return Planner(node, SLO(SLO_TTFT_P99_S, SLO_TPOT_P50_S), price,
                   duration_s=PLAN_DURATION_S, stats_interval_s=STATS_INTERVAL_S)


def single_replica() -> tuple[float, list[dict]]:
    return _planner().single_replica_rate()


def plan_point(replicas: int, rate: float) -> dict:
    return _planner().evaluate(replicas, rate)


def capacity_plans(pool: ProcessPoolExecutor,
                   single: tuple[float, list[dict]]) -> list[dict]:
    """The planner's points, run in parallel: what one replica sustains, then a grid of replica
    counts from 70% to 100% of `rate / that` for each rate; the fewest that meets the SLOs."""
    per_replica, single_curve = single
    _, source = replica_price(HARDWARE, TP, None)
    jobs = {}
    for rate in PLAN_RATES:
        guess = math.ceil(rate / per_replica)
        for n in sorted({max(1, round(guess * f)) for f in PLAN_GRID}):
            jobs[rate, n] = pool.submit(plan_point, n, rate)
    plans = []
    for rate in PLAN_RATES:
        curve = [fut.result() for (r, _), fut in sorted(jobs.items()) if r == rate]
        ok = [p for p in curve if p["meets_slo"]]
        best = ok[0] if ok else None
        plans.append({
            "rate_rps": rate, "price_assumption": source,
            "single_replica_rate_rps": round(per_replica, 3),
            "first_guess_replicas": math.ceil(rate / per_replica),
            "replicas": best["replicas"] if best else None, "chosen": best,
            "cost_per_1m_output_tokens": best["cost_per_1m_output_tokens"] if best else None,
            "fleet_price_per_hour": round(_planner().price_per_replica_hour
                                          * best["replicas"], 2) if best else None,
            "curve": curve, "single_replica_curve": single_curve})
    return plans


def crossing(points: list[dict], limit_ms: float) -> float | None:
    """Offered load (req/s) where p99 TTFT first crosses `limit_ms`, interpolated linearly."""
    pts = sorted(points, key=lambda p: p["rate_rps"])
    for a, b in zip(pts, pts[1:]):
        if a["ttft_p99_ms"] <= limit_ms < b["ttft_p99_ms"]:
            f = (limit_ms - a["ttft_p99_ms"]) / (b["ttft_p99_ms"] - a["ttft_p99_ms"])
            return round(a["rate_rps"] + f * (b["rate_rps"] - a["rate_rps"]), 1)
    return None


def plot(load: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for policy, pts in load.items():
        pts = sorted(pts, key=lambda p: p["rate_rps"])
        ax.plot([p["rate_rps"] for p in pts], [p["ttft_p99_ms"] / 1e3 for p in pts], "o-",
                label=policy)
    ax.axhline(SLO_TTFT_P99_S, color="grey", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel(f"offered load, req/s ({REPLICAS} replicas of {TP}x{HARDWARE}, {MODEL})")
    ax.set_ylabel("p99 TTFT, s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--load-duration-s", type=float, default=40.0)
    ap.add_argument("--chat-duration-s", type=float, default=45.0)
    ap.add_argument("--render-only", action="store_true",
                    help="re-render the markdown from the saved JSON (e.g. after the speed run)")
    ap.add_argument("--only-load", action="store_true",
                    help="rerun only the load curve, keeping the rest of the saved JSON")


def run(args: argparse.Namespace) -> int:
    if args.only_load:
        saved = json.loads(OUT_JSON.read_text())
        with ProcessPoolExecutor(args.jobs) as pool:
            jobs = [(p, pool.submit(fleet_point, p, DESIGN_TRAFFIC, REPLICAS * r,
                                    args.load_duration_s))
                    for p in POLICIES for r in PER_REPLICA_RPS]
            saved["load"] = {p: [] for p in POLICIES}
            for p, fut in jobs:
                saved["load"][p].append(fut.result())
        saved["crossing_1s_rps"] = {p: crossing(pts, 1000.0) for p, pts in saved["load"].items()}
        saved["durations_s"]["load"] = args.load_duration_s
        saved["load_rerun"] = {"command": " ".join(["everystop"] + sys.argv[1:]),
                               "loadavg_after": os.getloadavg()}
        write_result(saved, str(OUT_JSON))
        plot(saved["load"], IMG / "fleet_ttft_vs_load.png")
        DOC.write_text(render(saved))
        return 0
    if args.render_only:
        DOC.write_text(render(json.loads(OUT_JSON.read_text())))
        return 0
    if args.quick:
        args.load_duration_s, args.chat_duration_s = 1.0, 2.0
    t0, load_before = time.perf_counter(), os.getloadavg()
    with ProcessPoolExecutor(args.jobs) as pool:
        single = pool.submit(single_replica)  # first: the plans' grids wait for it
        load_jobs = [(p, pool.submit(fleet_point, p, DESIGN_TRAFFIC, REPLICAS * r,
                                     args.load_duration_s))
                     for p in POLICIES for r in PER_REPLICA_RPS]
        chat_jobs = [(p, pool.submit(fleet_point, p, CHAT, REPLICAS * CHAT_RPS_PER_REPLICA,
                                     args.chat_duration_s)) for p in CHAT_POLICIES]
        plan = capacity_plans(pool, single.result())
        load: dict[str, list[dict]] = {p: [] for p in POLICIES}
        for p, fut in load_jobs:
            load[p].append(fut.result())
        chat = {p: fut.result() for p, fut in chat_jobs}
    result = {
        "benchmark": "fleet_report", "quick": args.quick,
        "command": "everystop bench fleet-report" + (" --quick" if args.quick else ""),
        "model": MODEL, "hardware": HARDWARE, "tp": TP, "replicas": REPLICAS,
        "stats_interval_s": STATS_INTERVAL_S,
        "slo": {"ttft_p99_s": SLO_TTFT_P99_S, "tpot_p50_s": SLO_TPOT_P50_S},
        "durations_s": {"load": args.load_duration_s, "chat": args.chat_duration_s,
                        "plan": PLAN_DURATION_S}, "plan_grid": PLAN_GRID,
        "load": load, "crossing_1s_rps": {p: crossing(pts, 1000.0) for p, pts in load.items()},
        "chat": chat, "plans": plan,
        "wall_s": round(time.perf_counter() - t0, 1), "jobs": args.jobs,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpu": cpu_info(),
    }
    out_json = OUT_JSON.with_name("fleet_report_quick.json") if args.quick else OUT_JSON
    write_result(result, str(out_json))
    if not args.quick:
        IMG.mkdir(parents=True, exist_ok=True)
        plot(load, IMG / "fleet_ttft_vs_load.png")
        DOC.write_text(render(result))
        print(f"wrote {out_json}, {DOC}", file=sys.stderr)
    return 0
