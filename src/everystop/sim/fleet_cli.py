"""`everystop simulate --replicas N` and `everystop simulate plan`: the fleet simulator and the
capacity planner on the command line (the single-node `simulate` options build each replica)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from everystop.routing import POLICIES, make_router
from everystop.sim.fleet import simulate_fleet
from everystop.sim.fleet_metrics import summarize_fleet
from everystop.sim.fleet_workload import fleet_traffic, from_workload
from everystop.sim.node import Node, build_node
from everystop.sim.plan import DESIGN_TRAFFIC, SLO, Planner, replica_price
from everystop.sim.specs import hardware_keys, model_keys
from everystop.sim.workload import resolve_workload

TRAFFIC_HELP = ("fleet traffic spec, e.g. 'n=20000,rate=200,arrival=onoff:10:20:2,"
                "sessions=0.5:4:30,prefix=0.3:512,tenants=4,tiers=0.2:0.6:0.2' "
                "(see everystop/sim/fleet_workload.py); instead of --workload")


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    """The fleet options of `everystop simulate` (all default to the single node)."""
    g = p.add_argument_group("fleet")
    g.add_argument("--replicas", type=int, default=None,
                   help="simulate N replicas behind the router (1 = the single-node results)")
    g.add_argument("--router", default="least-loaded", choices=POLICIES)
    g.add_argument("--stats-interval-s", type=float, default=1.0,
                   help="how often the router gets fresh load reports (0 = every request)")
    g.add_argument("--affinity-margin", type=float, default=2.0)
    g.add_argument("--traffic", default=None, help=TRAFFIC_HELP)
    g.add_argument("--price-per-gpu-hour", type=float, default=None,
                   help="USD per GPU-hour for the fleet's $/1M tokens (default: the assumption "
                   "listed for the hardware in everystop/sim/plan.py)")


def run_fleet(args: argparse.Namespace, node: Node) -> int:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, not {args.replicas}")
    if (args.traffic is None) == (args.workload is None):
        raise ValueError("give exactly one of --workload (a trace or single-node spec) and "
                         "--traffic (a fleet traffic spec)")
    if args.traffic is not None:
        requests = fleet_traffic(args.traffic, node.cost.model.max_model_len)
    else:
        workload = resolve_workload(args.workload)
        if args.rate is not None:
            workload = workload.with_rate(args.rate or None, seed=args.seed)
        requests = from_workload(workload)
    router = make_router(args.router, affinity_margin=args.affinity_margin, seed=args.seed)
    result = simulate_fleet(requests, node.setup, node.cost.latency, args.replicas, router,
                            stats_interval_s=args.stats_interval_s)
    price, source = replica_price(args.hardware, args.tp, args.price_per_gpu_hour)
    report = {"node": node.describe(), "replicas": args.replicas, "router": args.router,
              "stats_interval_s": args.stats_interval_s, "price_assumption": source,
              "workload": args.traffic or args.workload,
              "summary": summarize_fleet(result, price)}
    _emit(report, args.out / "fleet.json" if args.out else None)
    return 0


def register_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="fewest replicas that meet the SLOs, and $/1M tokens",
                              description=__doc__)
    p.add_argument("--model", default="llama-3-70b", choices=model_keys())
    p.add_argument("--hardware", default="h100-sxm", choices=hardware_keys())
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--rate", type=float, required=True, help="requests per second to serve")
    p.add_argument("--slo-ttft-p99", type=float, required=True, help="seconds")
    p.add_argument("--slo-tpot-p50", type=float, required=True, help="seconds")
    p.add_argument("--traffic", default=DESIGN_TRAFFIC,
                   help="traffic shape: a fleet traffic spec without n, rate and seed "
                   f"(default: the design's, {DESIGN_TRAFFIC})")
    p.add_argument("--router", default="least-loaded", choices=POLICIES)
    p.add_argument("--duration-s", type=float, default=60.0,
                   help="simulated seconds of arrivals per point searched")
    p.add_argument("--stats-interval-s", type=float, default=1.0)
    p.add_argument("--price-per-gpu-hour", type=float, default=None)
    p.add_argument("--min-requests", type=int, default=400,
                   help="fewest requests simulated per point, whatever the rate and duration")
    p.add_argument("--resolution", type=float, default=0.02,
                   help="relative precision of the replica count (0.02: within 2%%)")
    p.add_argument("--max-replicas", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the plan JSON here")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    try:
        node = build_node(args.model, args.hardware, args.tp)
        price, source = replica_price(args.hardware, args.tp, args.price_per_gpu_hour)
        planner = Planner(node, SLO(args.slo_ttft_p99, args.slo_tpot_p50), price,
                          traffic=args.traffic, router=args.router, duration_s=args.duration_s,
                          stats_interval_s=args.stats_interval_s, seed=args.seed,
                          resolution=args.resolution, min_requests=args.min_requests,
                          progress=lambda p: print(json.dumps(p), file=sys.stderr))
        plan = planner.plan(args.rate, args.max_replicas)
    except ValueError as exc:
        print(f"everystop simulate plan: error: {exc}", file=sys.stderr)
        return 2
    _emit({"model": args.model, "hardware": args.hardware, "tp": args.tp,
           "slo": {"ttft_p99_s": args.slo_ttft_p99, "tpot_p50_s": args.slo_tpot_p50},
           "traffic": args.traffic, "router": args.router, "price_assumption": source,
           "cost_formula": "$/1M output tokens = fleet $/hour / (output tokens/s * 3600) * 1e6",
           **plan}, args.out)
    return 0


def _emit(report: dict, out: Path | None) -> None:
    text = json.dumps(report, indent=2, default=str)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)
