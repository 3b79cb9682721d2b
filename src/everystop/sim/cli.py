"""`everystop simulate`: the real scheduler on a modeled node, with a discrete-event clock;
`everystop simulate report` (the simulator report) and `everystop simulate calibrate` (fit the
cost model to measured iterations)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from everystop.config import parse_tpot_target
from everystop.sim import plan_cli
from everystop.sim.fleet_cli import add_fleet_args, run_fleet
from everystop.sim.metrics import DEFAULT_PRICE_PER_HOUR, summarize
from everystop.sim.node import SCHEDULING_MODES, build_node
from everystop.sim.report import write_run
from everystop.sim.simulator import simulate
from everystop.sim.specs import hardware_keys, model_keys
from everystop.subcommands import add_module_commands
from everystop.workload import resolve_workload

WORKLOAD_HELP = ("workload JSON file, or a synthetic spec such as "
                 "'n=512,prompt=uniform:128:1024,output=uniform:20:800,rate=4,seed=0' "
                 "(keys: n, prompt, output, rate, priority=F0:F1:F2, prefix=FRAC:TOKENS, "
                 "tenants, seed; distributions const:V, uniform:LO:HI, "
                 "lognormal:MEDIAN:SIGMA[:MAX])")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("simulate", help="simulate the scheduler on modeled hardware",
                              description=__doc__)
    p.add_argument("--model", default="llama-3-70b", choices=model_keys())
    p.add_argument("--hardware", default="a100-80gb", choices=hardware_keys())
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--workload", default=None,
                   help=WORKLOAD_HELP + " (required to simulate one node)")
    p.add_argument("--scheduling", default="chunked", choices=SCHEDULING_MODES)
    p.add_argument("--rate", type=float, default=None,
                   help="override arrivals with Poisson arrivals at R requests/s (0 = all at t=0)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=None, help="static batching size")
    p.add_argument("--tpot-target-ms", type=parse_tpot_target, default=None,
                   metavar="MS|off|TIER:MS,...",
                   help="step-time target for the prefill budget, as `serve` takes it (default "
                   "here: off, the fixed token budget the committed tables use; tiers left "
                   "out have no target)")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding with up to K proposals per sequence, sized each "
                   "pass by the scheduler's rule (default 0: off)")
    p.add_argument("--spec-acceptance", type=float, default=0.7, metavar="A",
                   help="with --speculative-tokens: the chance each proposal is kept (0-1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--activation-reserve-gb", type=float, default=8.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--swap-space-gb", type=float, default=16.0)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--price-per-hour", type=float, default=DEFAULT_PRICE_PER_HOUR)
    p.add_argument("--eff-compute", type=float, default=None)
    p.add_argument("--eff-memory", type=float, default=None)
    p.add_argument("--out", type=Path, default=None, help="directory for JSON and PNG plots")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="arrival seed for --rate")
    add_fleet_args(p)
    p.set_defaults(func=run)
    sub = p.add_subparsers(dest="simulate_command", metavar="{report,calibrate,plan}")
    add_module_commands(sub, SUBCOMMANDS)


# (subcommand, module with add_arguments(parser) and run(args), help)
SUBCOMMANDS = [
    ("report", "everystop.sim.design_report", "regenerate docs/simulator-report.md, its plots "
     "and benchmarks/results/sim/report.json"),
    ("calibrate", "everystop.sim.calibrate", "fit the cost model to measured iterations (or a "
     "synthetic self-test) and predict another workload"),
    ("plan", "everystop.sim.plan_cli", plan_cli.HELP),
]


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as exc:  # impossible hardware or configuration: say which, exit 2
        print(f"everystop simulate: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in (("eff_compute", args.eff_compute),
                                   ("eff_memory", args.eff_memory)) if v is not None}
    tpot: dict[str, object] = {}
    if args.tpot_target_ms is not None:
        plain, per_tier = args.tpot_target_ms
        tpot = {"tpot_target_ms": plain, "tpot_target_ms_per_tier": per_tier}
    node = build_node(args.model, args.hardware, args.tp, args.scheduling,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      activation_reserve_bytes=args.activation_reserve_gb * 1e9,
                      block_size=args.block_size, swap_space_bytes=args.swap_space_gb * 2**30,
                      enable_prefix_caching=not args.no_prefix_caching, hw_overrides=overrides,
                      max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      chunk_size=args.chunk_size, max_batch_size=args.max_batch_size,
                      speculative_tokens=args.speculative_tokens,
                      spec_acceptance=args.spec_acceptance, **tpot)
    if args.replicas is not None:
        if args.speculative_tokens:
            raise ValueError("--speculative-tokens is simulated on one node, not with --replicas")
        return run_fleet(args, node)
    if args.workload is None:
        raise ValueError("--workload is required (or --replicas, or a subcommand: report, "
                         "calibrate, plan)")
    workload = resolve_workload(args.workload)
    if args.rate is not None:
        workload = workload.with_rate(args.rate or None, seed=args.seed)
    result = simulate(workload, node.setup, node.cost.latency)
    summary = summarize(result, node.cost, args.price_per_hour)
    described = {**node.describe(), "workload": workload.name,
                 "capacity": node.capacity.to_dict()}
    if args.out:
        for path in write_run(args.out, summary, result, described, plots=not args.no_plots):
            print(f"wrote {path}")
    print(json.dumps({"node": described, "summary": summary}, indent=2, default=str))
    return 0
