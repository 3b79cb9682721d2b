"""Summaries of a simulation: throughput, latency percentiles, queue wait by tier, cost, and the
roofline bound for the same sequence of passes."""

from __future__ import annotations

from collections.abc import Sequence

from everystop.sim.cost_model import CostModel
from everystop.sim.simulator import SimResult

DEFAULT_PRICE_PER_HOUR = 8.20  # the design's 4xA100 80GB spot node


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method), None for no data."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def cost_per_million(tokens_per_s: float, price_per_hour: float) -> float:
    """Dollars per 1M output tokens for a node at `price_per_hour` producing `tokens_per_s`."""
    return price_per_hour / 3600.0 / tokens_per_s * 1e6


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def summarize(result: SimResult, cost: CostModel | None = None,
              price_per_hour: float = DEFAULT_PRICE_PER_HOUR) -> dict:
    done = [r for r in result.requests if r.finished_time is not None]
    ttft = [r.first_token_time - r.arrival_time for r in done if r.first_token_time is not None]
    tpot = [(r.finished_time - r.first_token_time) / (r.num_output_tokens - 1)
            for r in done if r.num_output_tokens > 1 and r.first_token_time is not None]
    out_tokens = sum(r.num_output_tokens for r in done)
    start = min((r.arrival_time for r in result.requests), default=0.0)
    end = max((r.finished_time for r in done), default=start)
    makespan = end - start
    tok_s = out_tokens / makespan if makespan > 0 else 0.0
    waits: dict[str, list[float]] = {}
    for r in done:
        if r.admitted_time is not None:
            waits.setdefault(str(r.priority), []).append(r.admitted_time - r.arrival_time)
    busy = sum(it.latency_s for it in result.iterations)
    running = [o.num_running for o in result.occupancy]
    summary = {
        "num_requests": len(result.requests) + len(result.rejected),
        "num_finished": len(done),
        "num_rejected": len(result.rejected),
        "output_tokens": out_tokens,
        "makespan_s": round(makespan, 4),
        "output_tokens_per_s": round(tok_s, 1),
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)), "tpot_p99_ms": _ms(percentile(tpot, 99)),
        "queue_wait_by_priority": {
            tier: {"n": len(w), "p50_ms": _ms(percentile(w, 50)),
                   "p99_ms": _ms(percentile(w, 99))} for tier, w in sorted(waits.items())},
        "num_iterations": len(result.iterations),
        "busy_s": round(busy, 4),
        "mean_running_seqs": round(sum(running) / len(running), 2) if running else 0.0,
        "max_running_seqs": max(running, default=0),
        "preemptions": dict(result.num_preemptions),
        "price_per_hour": price_per_hour,
        "cost_per_1m_output_tokens": (round(cost_per_million(tok_s, price_per_hour), 4)
                                      if tok_s else None),
    }
    if cost is not None and cost.hw is not None:
        summary["bound"] = roofline_summary(result, cost, out_tokens)
    return summary


def roofline_summary(result: SimResult, cost: CostModel, out_tokens: int) -> dict:
    """The physical floor for the passes this run actually made: each pass at peak FLOPs or
    full HBM bandwidth (whichever binds), no comm, no overhead, no idle time."""
    floor = sum(cost.roofline_s(it.shape) for it in result.iterations)
    decode_only = [it for it in result.iterations if it.shape.num_prefill_tokens == 0]
    step_ratio = [it.latency_s / cost.roofline_s(it.shape) for it in decode_only]
    return {
        "roofline_busy_s": round(floor, 4),
        "roofline_output_tokens_per_s": round(out_tokens / floor, 1) if floor else None,
        "modeled_over_roofline_decode_step": (round(sum(step_ratio) / len(step_ratio), 3)
                                              if step_ratio else None),
        "min_decode_step_ms_roofline": _ms(min((cost.roofline_s(it.shape)
                                                for it in decode_only), default=None)),
    }
