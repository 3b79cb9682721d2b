"""Capacity planning: the fewest replicas that meet the SLOs at a request rate, and what a token
costs then.

The search runs the fleet simulator, so queueing, batching, chunked prefill and the router all
count. It first finds what one replica sustains (bisecting the rate on a single replica), takes
`ceil(rate / that)` replicas as the first guess, then gallops down from it while the fleet still
meets the SLOs (many replicas pool their queues, so the guess is an upper bound more often than
not) or up until it does, in steps of `resolution` of the count that double, and bisects the
bracket down to `resolution`. Every point it simulated is returned: the curve.

Cost is the design's formula, $/1M output tokens = price per hour / output tokens per hour * 1e6,
for the whole fleet paid for the whole run, at an hourly GPU price that is an assumption (below,
or `--price-per-gpu-hour`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from everystop.routing import make_router
from everystop.sim.fleet_metrics import summarize_fleet
from everystop.sim.fleet_run import simulate_fleet
from everystop.sim.fleet_workload import fleet_traffic
from everystop.sim.node import Node

# USD per GPU-hour. NOTE: assumptions, not quotes: cloud prices move and differ by provider.
GPU_HOUR_PRICE = {
    "a100-80gb": (2.05, "the design's spot 4xA100 80GB node, $8.20/h, per GPU"),
    "a100-40gb": (1.50, "assumption: ~3/4 of the 80GB part's spot price"),
    "h100-sxm": (3.00, "assumption: typical 2025 on-demand H100 SXM cloud price, $2-4/GPU-hour"),
    "h200": (3.80, "assumption: typical 2025 on-demand H200 cloud price, $3-5/GPU-hour"),
}

# The design's traffic shape: chat prompts up to 1,024 tokens, replies of 20-800 tokens.
DESIGN_TRAFFIC = "prompt=uniform:128:1024,output=uniform:20:800"


@dataclass(frozen=True)
class SLO:
    ttft_p99_s: float
    tpot_p50_s: float

    def met(self, summary: dict) -> bool:
        ttft, tpot = summary["ttft_p99_ms"], summary["tpot_p50_ms"]
        return (summary["num_rejected"] == 0 and ttft is not None and tpot is not None
                and ttft <= self.ttft_p99_s * 1e3 and tpot <= self.tpot_p50_s * 1e3)


def replica_price(hardware: str, tp: int, price_per_gpu_hour: float | None) -> tuple[float, str]:
    """Hourly price of one replica (tp GPUs) and where the figure comes from."""
    if price_per_gpu_hour is not None:
        return price_per_gpu_hour * tp, f"${price_per_gpu_hour}/GPU-hour (given)"
    per_gpu, source = GPU_HOUR_PRICE[hardware]
    return per_gpu * tp, f"${per_gpu}/GPU-hour: {source}"


@dataclass
class Planner:
    node: Node
    slo: SLO
    price_per_replica_hour: float
    traffic: str = DESIGN_TRAFFIC  # spec without n/rate/seed
    router: str = "least-loaded"
    duration_s: float = 60.0  # simulated seconds of arrivals per point
    min_requests: int = 400
    stats_interval_s: float = 1.0
    seed: int = 0
    resolution: float = 0.02  # relative precision of the replica count
    progress: Callable[[dict], None] | None = None
    workers: int = 1  # processes per fleet run (sim/fleet_parallel.py; the same results)
    _single: tuple[float, list[dict]] | None = field(default=None, init=False, repr=False)

    def evaluate(self, replicas: int, rate: float) -> dict:
        n = max(self.min_requests, math.ceil(rate * self.duration_s))
        spec = f"{self.traffic},n={n},rate={rate},seed={self.seed}"
        result = simulate_fleet(fleet_traffic(spec, self.node.cost.model.max_model_len),
                                self.node.setup, self.node.cost.latency, replicas,
                                make_router(self.router, seed=self.seed),
                                stats_interval_s=self.stats_interval_s, workers=self.workers)
        summary = summarize_fleet(result, self.price_per_replica_hour)
        point = {"replicas": replicas, "rate_rps": rate, "meets_slo": self.slo.met(summary),
                 **{k: summary[k] for k in ("num_finished", "ttft_p50_ms", "ttft_p99_ms",
                                            "tpot_p50_ms", "tpot_p99_ms", "output_tokens_per_s",
                                            "cost_per_1m_output_tokens", "num_rejected")}}
        if self.progress:
            self.progress(point)
        return point

    def single_replica_rate(self, hi: float = 4.0, steps: int = 5) -> tuple[float, list[dict]]:
        """The highest rate (bisected) one replica serves within the SLOs."""
        curve, lo = [], 0.0
        while True:  # make sure `hi` fails
            p = self.evaluate(1, hi)
            curve.append(p)
            if not p["meets_slo"]:
                break
            lo, hi = hi, hi * 2
        for _ in range(steps):
            mid = (lo + hi) / 2
            p = self.evaluate(1, mid)
            curve.append(p)
            lo, hi = (mid, hi) if p["meets_slo"] else (lo, mid)
        return lo, curve

    def plan(self, rate: float, max_replicas: int = 4096) -> dict:
        if self._single is None:
            self._single = self.single_replica_rate()
        per_replica, single_curve = self._single
        if per_replica <= 0:
            raise ValueError("one replica cannot meet these SLOs at any rate searched")
        guess = min(max_replicas, max(1, math.ceil(rate / per_replica)))
        n, curve = self._search(rate, guess, max_replicas)
        best = curve[n]
        return {"rate_rps": rate, "replicas": n, "single_replica_rate_rps": round(per_replica, 3),
                "first_guess_replicas": guess, "chosen": best,
                "cost_per_1m_output_tokens": best["cost_per_1m_output_tokens"],
                "fleet_price_per_hour": round(self.price_per_replica_hour * n, 2),
                "curve": [curve[k] for k in sorted(curve)], "single_replica_curve": single_curve}

    def _search(self, rate: float, guess: int, max_replicas: int) -> tuple[int, dict[int, dict]]:
        """Fewest replicas meeting the SLOs: gallop from the guess to bracket it, then bisect
        (assumes more replicas never hurt)."""
        curve: dict[int, dict] = {}

        def ok(n: int) -> bool:
            if n not in curve:
                curve[n] = self.evaluate(n, rate)
            return bool(curve[n]["meets_slo"])

        step = max(1, round(guess * self.resolution))  # gallop in steps of the precision
        if ok(guess):
            lo, hi = 0, guess
            while hi - step >= 1:
                if not ok(hi - step):
                    lo = hi - step
                    break
                hi, step = hi - step, step * 2
        else:
            lo = guess
            while True:
                cand = min(lo + step, max_replicas)
                if cand == lo:
                    raise ValueError(f"no fleet up to {max_replicas} replicas meets the SLOs")
                if ok(cand):
                    hi = cand
                    break
                lo, step = cand, step * 2
        # Past ~50 replicas, one more or less is within the noise of a simulated minute: stop
        # at 2% (the answer is then at most 2% above the fewest).
        while hi - lo > max(1, round(hi * self.resolution)):
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi, curve
