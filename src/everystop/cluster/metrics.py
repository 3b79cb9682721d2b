"""Cluster series for the ingress's /metrics: each replica's load report with a `replica`
label, the router's decisions (`everystop_router_requests_total{replica,policy}`, why it made
them, `everystop_router_decisions_total{policy,reason}`, the score at the last decision),
re-routes by reason, and every request's outcome."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from everystop.cluster.front import ClusterEngine

_REPLICA_GAUGES = (
    ("num_requests_running", "Sequences in the replica's running batch", "num_running"),
    ("num_requests_waiting", "Requests queued on the replica", "num_waiting"),
    ("num_requests_swapped", "Requests whose KV sits in the replica's host swap", "num_swapped"),
    ("kv_cache_usage_perc", "Fraction of the replica's KV blocks in use (0-1)", "kv_usage"),
    ("kv_cache_free_blocks", "Free KV blocks on the replica", "num_free_blocks"),
    ("kv_cache_total_blocks", "KV blocks in the replica's pool", "num_total_blocks"),
)
_REPLICA_COUNTERS = (
    # In tokens, as the series say (prefix_queries/prefix_hits count lookups: a request that
    # waits for blocks looks up again at every step, which skewed the routing bench's rate).
    ("prefix_cache_queries", "Prefix-cache queried tokens on the replica",
     "prefix_query_tokens"),
    ("prefix_cache_hits", "Prefix-cache hit tokens on the replica", "prefix_hit_tokens"),
    ("preemptions_recompute", "Recompute preemptions on the replica",
     "num_preemptions_recompute"),
    ("preemptions_swap", "Swap preemptions on the replica", "num_preemptions_swap"),
)


class ClusterCollector(Collector):
    """Read at scrape time from the router's last reports (at most one report period old)."""

    def __init__(self, front: ClusterEngine) -> None:
        self.front = front

    def collect(self) -> Iterator[Any]:
        reports = self.front.reports()
        for name, doc, key in _REPLICA_GAUGES:
            family = GaugeMetricFamily(f"everystop_replica_{name}", doc, labels=["replica"])
            for rid, report in reports.items():
                if report.get("stats"):
                    family.add_metric([rid], float(report["stats"][key]))
            yield family
        for name, doc, key in _REPLICA_COUNTERS:
            counter = CounterMetricFamily(f"everystop_replica_{name}", doc, labels=["replica"])
            for rid, report in reports.items():
                if report.get("stats"):
                    counter.add_metric([rid], float(report["stats"][key]))
            yield counter
        queued = GaugeMetricFamily("everystop_replica_prefill_tokens_queued",
                                   "Prompt tokens waiting for prefill on the replica",
                                   labels=["replica"])
        healthy = GaugeMetricFamily("everystop_replica_healthy",
                                    "1 if the replica's engine loop is running",
                                    labels=["replica"])
        for rid, report in reports.items():
            queued.add_metric([rid], float(report.get("prefill_tokens_queued", 0)))
            healthy.add_metric([rid], float(report.get("health") == "ok"))
        yield queued
        yield healthy
        yield from self._router_series()
        outcomes = CounterMetricFamily("everystop_cluster_requests",
                                       "Requests by how they ended", labels=["outcome"])
        for outcome, n in sorted(self.front.outcomes.items()):
            outcomes.add_metric([outcome], n)
        yield outcomes
        retries = CounterMetricFamily("everystop_router_retries",
                                      "Requests re-routed, by why", labels=["reason"])
        for reason, n in sorted(self.front.retries.items()):
            retries.add_metric([reason], n)
        yield retries

    def _router_series(self) -> Iterator[Any]:
        requests = CounterMetricFamily("everystop_router_requests",
                                       "Requests the router sent to each replica",
                                       labels=["replica", "policy"])
        why = CounterMetricFamily("everystop_router_decisions",
                                  "Requests the router sent, by why its policy chose that "
                                  "replica (e.g. prefix-affinity: affinity, margin, kv_tier, "
                                  "new_prefix)", labels=["policy", "reason"])
        score = GaugeMetricFamily("everystop_router_score",
                                  "Each replica's score at the router's last decision "
                                  "(lower is better)", labels=["replica", "policy"])
        for router in self.front.routers():
            for rid, n in sorted(router.decisions.items()):
                requests.add_metric([rid, router.policy_name], n)
            for reason, n in sorted(router.reasons.items()):
                why.add_metric([router.policy_name, reason], n)
            for rid, value in sorted(router.last_score.items()):
                score.add_metric([rid, router.policy_name], value)
        yield requests
        yield why
        yield score
