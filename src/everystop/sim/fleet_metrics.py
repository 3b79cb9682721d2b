"""Summaries of a fleet run: latency percentiles, throughput, prefix-cache hits, balance, cost."""

from __future__ import annotations

from everystop.sim.fleet import FleetResult
from everystop.sim.metrics import cost_per_million, percentile


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def summarize_fleet(result: FleetResult, price_per_replica_hour: float) -> dict:
    """Everything a capacity plan reads, from the finished requests' timings.

    Cost is the design's formula over the whole fleet: every replica is paid for the whole
    makespan, busy or not (price_per_replica_hour * replicas / output tokens per hour)."""
    done = result.finished
    ttft = [f.first_token_s - f.arrival_s for f in done if f.first_token_s is not None]
    tpot = [(f.finished_s - f.first_token_s) / (f.num_output_tokens - 1)
            for f in done if f.num_output_tokens > 1 and f.first_token_s is not None]
    out_tokens = sum(f.num_output_tokens for f in done)
    prompt_tokens = sum(f.num_prompt_tokens for f in done)
    cached = sum(f.num_cached_tokens for f in done)
    start = min((f.arrival_s for f in done), default=0.0)
    makespan = max((f.finished_s for f in done), default=start) - start
    tok_s = out_tokens / makespan if makespan > 0 else 0.0
    replicas = len(result.num_passes)
    routed = result.num_routed or [0] * replicas
    fleet_price = price_per_replica_hour * replicas
    return {
        "num_replicas": replicas,
        "num_finished": len(done),
        "num_rejected": len(result.rejected),
        "offered_rate_rps": round(len(done) / (max(f.arrival_s for f in done) - start), 3)
        if len(done) > 1 else None,
        "makespan_s": round(makespan, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(tok_s, 1),
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)), "tpot_p99_ms": _ms(percentile(tpot, 99)),
        "prefix_hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else None,
        "num_passes": sum(result.num_passes),
        "num_preemptions": result.num_preemptions,
        "busy_fraction_min_max": [round(min(result.busy_s) / makespan, 3),
                                  round(max(result.busy_s) / makespan, 3)] if makespan else None,
        "routed_min_max": [min(routed), max(routed)],
        "price_per_replica_hour": price_per_replica_hour,
        "cost_per_1m_output_tokens": (round(cost_per_million(tok_s, fleet_price), 4)
                                      if tok_s else None),
    }
