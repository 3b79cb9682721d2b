"""The routing bench's workloads through the fleet simulator: the same policies, prompts and
Poisson arrivals, no machine noise, several seeds. It answers what the live run on a shared
machine cannot: how far a policy can move each statistic on this workload at all.

Pass latency is a plain linear model of a one-thread CPU replica (per-token costs as flags),
not a calibrated one: the comparison between policies is the point, not the absolute times.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import Counter
from typing import Any

from everystop.config import SchedulerConfig
from everystop.routing import make_router
from everystop.sim.cost_model import IterationShape
from everystop.sim.fleet_run import simulate_fleet
from everystop.sim.fleet_workload import FleetRequest
from everystop.sim.simulator import SimSetup
from everystop.stats import percentile
from everystop.workload import Workload


def add_sim_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("--simulate: the fleet simulator instead of live replicas")
    g.add_argument("--simulate", action="store_true")
    g.add_argument("--sim-rates", default="4,12", help="arrival rates (req/s) to simulate")
    g.add_argument("--sim-loads", default=None,
                   help="arrival rates as fractions of the simulated capacity (each seed's "
                        "workload all at once, least-loaded), as the live run measures it; "
                        "replaces --sim-rates")
    g.add_argument("--sim-seeds", type=int, default=5, help="workload seeds averaged per cell")
    g.add_argument("--sim-step-ms", type=float, default=12.0, help="fixed cost of a pass")
    g.add_argument("--sim-token-ms", type=float, default=0.8, help="cost per token in a pass")
    g.add_argument("--sim-stats-interval-s", type=float, default=0.2,
                   help="how often the router gets fresh reports (Ray: the stats period)")


def _requests(workload: Workload, ids: dict, rate: float, seed: int) -> list[FleetRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    for r in workload.requests:
        t += rng.expovariate(rate)
        out.append(FleetRequest(r.id, t, ids[r.id], r.max_tokens, tenant=r.tenant))
    return out


def simulate_policy(make: Any, policy: str, rate: float, args: argparse.Namespace,
                    setup: SimSetup) -> dict[str, float]:
    """Mean over seeds of p99 TTFT (all, short, long prompts), hit rate, output tok/s and the
    router's decisions by reason."""
    step_s, token_s = args.sim_step_ms / 1000, args.sim_token_ms / 1000

    def latency(shape: IterationShape) -> float:
        return step_s + token_s * shape.num_tokens

    rows = []
    reasons: Counter[str] = Counter()
    for seed in range(1, args.sim_seeds + 1):
        workload, ids = make(seed)
        router = make_router(policy, seed=seed)
        res = simulate_fleet(_requests(workload, ids, rate, seed), setup, latency, 2, router,
                             stats_interval_s=args.sim_stats_interval_s)
        reasons.update(router.reasons)
        prefix_len = workload.spec.get("prefix_len")
        done = res.finished
        ttft = [(f.first_token_s or f.finished_s) - f.arrival_s for f in done]
        longs = [t for t, f in zip(ttft, done, strict=True) if f.num_prompt_tokens >= 1000]
        shorts = [t for t, f in zip(ttft, done, strict=True) if f.num_prompt_tokens < 1000]
        rows.append({
            "p99_ttft_ms": 1000 * percentile(ttft, 99),
            "short_p99_ttft_ms": 1000 * percentile(shorts, 99),
            "long_p99_ttft_ms": 1000 * percentile(longs, 99) if longs else 0.0,
            "hit_rate": sum(f.num_cached_tokens for f in done)
            / sum(f.num_prompt_tokens for f in done),
            "output_tok_s": sum(f.num_output_tokens for f in done)
            / max(f.finished_s for f in done),
            **(_prefix_misses(done, ids, prefix_len) if prefix_len else {})})
    means = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
    # Why the router chose as it did, requests per seed (prefix-affinity: affinity, margin...).
    return {**means, **{f"decisions_{k}": n / len(rows) for k, n in sorted(reasons.items())}}


def _prefix_misses(done: list[Any], ids: dict, prefix_len: int) -> dict[str, float]:
    """Shared-prefix requests whose system prompt was not (all) cached: the first request of
    each prompt (no router can help those) and the later ones (evicted, or sent elsewhere)."""
    seen: set[tuple[int, ...]] = set()
    first = later = 0
    for f in sorted(done, key=lambda f: f.arrival_s):
        prefix = tuple(ids[f.request_id][:prefix_len])
        if f.num_cached_tokens < prefix_len:
            if prefix in seen:
                later += 1
            else:
                first += 1
        seen.add(prefix)
    return {"prefix_misses_first": first, "prefix_misses_later": later}


def simulated_capacity(make: Any, args: argparse.Namespace, setup: SimSetup) -> float:
    """Requests per second with every request arriving at once (the live run's calibration)."""
    step_s, token_s = args.sim_step_ms / 1000, args.sim_token_ms / 1000
    rates = []
    for seed in range(1, args.sim_seeds + 1):
        workload, ids = make(seed)
        at_once = [FleetRequest(r.id, 0.0, ids[r.id], r.max_tokens, tenant=r.tenant)
                   for r in workload.requests]
        res = simulate_fleet(at_once, setup, lambda shape: step_s + token_s * shape.num_tokens,
                             2, make_router("least-loaded"),
                             stats_interval_s=args.sim_stats_interval_s)
        rates.append(len(res.finished) / max(f.finished_s for f in res.finished))
    return statistics.mean(rates)


def simulate_all(tokens: list[int], args: argparse.Namespace, policies: list[str],
                 workloads: dict[str, tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
    """workloads: name -> (seed -> (Workload, ids), that workload's server settings)."""
    out: dict[str, Any] = {"latency_model": {"step_ms": args.sim_step_ms,
                                             "token_ms": args.sim_token_ms},
                           "seeds": args.sim_seeds,
                           "stats_interval_s": args.sim_stats_interval_s}
    for name, (make, server) in workloads.items():
        setup = SimSetup(SchedulerConfig(max_num_seqs=server["max_num_seqs"],
                                         max_num_batched_tokens=server["max_num_batched_tokens"]),
                         num_gpu_blocks=server["num_gpu_blocks"])
        cells: dict[str, Any] = {}
        capacity = simulated_capacity(make, args, setup) if args.sim_loads else None
        rates = ([capacity * float(x) for x in args.sim_loads.split(",")] if capacity
                 else [float(r) for r in args.sim_rates.split(",")])
        for rate in rates:
            cells[f"{rate:.3g}"] = {p: simulate_policy(make, p, rate, args, setup)
                                    for p in policies}
            for p, v in cells[f"{rate:.3g}"].items():
                print(f"sim {name} rate {rate:.3g} {p}: " + " ".join(
                    f"{k} {x:.3g}" for k, x in v.items()), flush=True)
        out[name] = {"server": server, "capacity_req_s": capacity, "by_rate_req_s": cells}
    return out
