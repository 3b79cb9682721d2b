"""`everystop simulate plan`: the fewest replicas that meet the SLOs at a request rate, the curve
searched, and $/1M output tokens at a stated price (see `everystop.sim.plan`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from everystop.routing import POLICIES
from everystop.sim.fleet_cli import emit
from everystop.sim.node import build_node
from everystop.sim.plan import DESIGN_TRAFFIC, SLO, Planner, replica_price
from everystop.sim.specs import hardware_keys, model_keys

HELP = "fewest replicas that meet the SLOs, and $/1M output tokens"


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--workers", type=int, default=1,
                   help="processes per simulated fleet (the same plan; one per core helps most)")
    p.add_argument("--out", type=Path, default=None, help="write the plan JSON here")


def run(args: argparse.Namespace) -> int:
    try:
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, not {args.workers}")
        node = build_node(args.model, args.hardware, args.tp)
        price, source = replica_price(args.hardware, args.tp, args.price_per_gpu_hour)
        planner = Planner(node, SLO(args.slo_ttft_p99, args.slo_tpot_p50), price,
                          traffic=args.traffic, router=args.router, duration_s=args.duration_s,
                          stats_interval_s=args.stats_interval_s, seed=args.seed,
                          resolution=args.resolution, min_requests=args.min_requests,
                          workers=args.workers,
                          progress=lambda p: print(json.dumps(p), file=sys.stderr))
        plan = planner.plan(args.rate, args.max_replicas)
    except ValueError as exc:
        print(f"everystop simulate plan: error: {exc}", file=sys.stderr)
        return 2
    emit({"model": args.model, "hardware": args.hardware, "tp": args.tp,
           "slo": {"ttft_p99_s": args.slo_ttft_p99, "tpot_p50_s": args.slo_tpot_p50},
           "traffic": args.traffic, "router": args.router, "price_assumption": source,
           "cost_formula": "$/1M output tokens = fleet $/hour / (output tokens/s * 3600) * 1e6",
           **plan}, args.out)
    return 0
