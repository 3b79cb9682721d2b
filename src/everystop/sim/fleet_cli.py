"""`everystop simulate --replicas N`: the fleet simulator on the command line (the single-node
`simulate` options build each replica)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from everystop.routing import DEFAULT_AFFINITY_MARGIN, POLICIES, make_router
from everystop.sim.fleet_metrics import summarize_fleet
from everystop.sim.fleet_run import simulate_fleet
from everystop.sim.fleet_workload import fleet_traffic, from_workload
from everystop.sim.node import Node
from everystop.sim.plan import replica_price
from everystop.workload import resolve_workload

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
    g.add_argument("--affinity-margin", type=float, default=DEFAULT_AFFINITY_MARGIN)
    g.add_argument("--traffic", default=None, help=TRAFFIC_HELP)
    g.add_argument("--workers", type=int, default=1,
                   help="spread the replicas over this many processes (the same results; "
                   "one per core is the most that helps)")
    g.add_argument("--price-per-gpu-hour", type=float, default=None,
                   help="USD per GPU-hour for the fleet's $/1M tokens (default: the assumption "
                   "listed for the hardware in everystop/sim/plan.py)")


def run_fleet(args: argparse.Namespace, node: Node) -> int:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, not {args.replicas}")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, not {args.workers}")
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
                            stats_interval_s=args.stats_interval_s, workers=args.workers)
    price, source = replica_price(args.hardware, args.tp, args.price_per_gpu_hour)
    report = {"node": node.describe(), "replicas": args.replicas, "router": args.router,
              "stats_interval_s": args.stats_interval_s, "price_assumption": source,
              "workload": args.traffic or args.workload,
              "summary": summarize_fleet(result, price)}
    emit(report, args.out / "fleet.json" if args.out else None)
    return 0


def emit(report: dict, out: Path | None) -> None:
    text = json.dumps(report, indent=2, default=str)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)
