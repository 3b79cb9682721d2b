"""Prometheus metrics with vLLM-style names (`everystop:*`), on a private registry.

Three sources feed them:
  - engine listeners (engine thread): per-iteration latency and token counts, and per finished
    request its TTFT, queue time, end-to-end latency and token counts;
  - the routes (event loop): inter-token latency as tokens reach the client, 429s by reason;
  - a collector read at scrape time: queue lengths, KV usage, prefix-cache and preemption
    counters straight from the scheduler, so they are never stale.

Tenant labels are bounded: the first `max_tenants` tenants seen keep their name, any later one
is reported as "other" (an unbounded label set would grow the registry without limit).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from everystop.core.outputs import IterationRecord, RequestOutput, SchedulerOutput, SchedulerStats
from everystop.core.request import Request
from everystop.engine.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class TenantLabels:
    """Maps tenant ids to a bounded set of label values."""

    def __init__(self, max_tenants: int = 20) -> None:
        self.max_tenants = max_tenants
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._known:
                return tenant
            if len(self._known) < self.max_tenants:
                self._known.add(tenant)
                return tenant
        return "other"


class ServerMetrics:
    def __init__(self, max_tenants: int = 20) -> None:
        self.registry = CollectorRegistry()
        self.tenant_label = TenantLabels(max_tenants)
        r = self.registry
        lbl = ["priority", "tenant"]
        self.ttft = Histogram("everystop:time_to_first_token_seconds", "Time to first token",
                              lbl, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("everystop:inter_token_latency_seconds",
                             "Time between tokens reaching the client", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("everystop:e2e_request_latency_seconds", "Arrival to finish", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("everystop:request_queue_time_seconds",
                                    "Arrival to first scheduled", lbl,
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.iteration_latency = Histogram("everystop:iteration_latency_seconds",
                                           "One engine step", buckets=_LATENCY_BUCKETS,
                                           registry=r)
        self.prefill_tokens_iter = Histogram("everystop:iteration_prefill_tokens",
                                             "Prefill tokens per engine step",
                                             buckets=_TOKEN_BUCKETS, registry=r)
        self.decode_tokens_iter = Histogram("everystop:iteration_decode_tokens",
                                            "Decode tokens per engine step",
                                            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_success = Counter("everystop:request_success", "Finished requests",
                                       ["finished_reason", "priority"], registry=r)
        self.prompt_tokens = Counter("everystop:prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("everystop:generation_tokens", "Tokens generated",
                                         registry=r)
        self.rejected = Counter("everystop:requests_rejected", "429 answers by reason",
                                ["reason", "priority"], registry=r)

    def attach(self, async_engine: AsyncEngine) -> None:
        """Hook the engine's listeners and the scrape-time collector."""
        async_engine.add_listeners(self.on_iteration, self.on_finished)
        self.registry.register(_EngineCollector(async_engine))

    # -- engine thread ---------------------------------------------------------------------------
    def on_iteration(self, record: IterationRecord, _: SchedulerOutput) -> None:
        self.iteration_latency.observe(record.latency_s)
        self.prefill_tokens_iter.observe(record.num_prefill_tokens)
        self.decode_tokens_iter.observe(record.num_decode_tokens)

    def on_finished(self, req: Request, out: RequestOutput) -> None:
        labels = (str(req.priority), self.tenant_label(req.tenant))
        m = out.metrics
        if m is not None:
            if m.ttft_s is not None:
                self.ttft.labels(*labels).observe(m.ttft_s)
            if m.queue_wait_s is not None:
                self.queue_time.labels(*labels).observe(m.queue_wait_s)
            if m.finished_time is not None:
                self.e2e.labels(*labels).observe(m.finished_time - m.arrival_time)
        self.request_success.labels(out.finish_reason or "abort", str(req.priority)).inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))

    # -- event loop -----------------------------------------------------------------------------
    def observe_itl(self, priority: int, tenant: str, gap_s: float, num_tokens: int) -> None:
        child = self.itl.labels(str(priority), self.tenant_label(tenant))
        per_token = gap_s / max(1, num_tokens)
        for _ in range(num_tokens):
            child.observe(per_token)

    def count_rejected(self, reason: str, priority: int) -> None:
        self.rejected.labels(reason, str(priority)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Scheduler state read at scrape time (plain attribute reads; no engine lock)."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.front = async_engine

    def collect(self) -> Iterator[Any]:
        stats = self.front.stats()
        for name, doc, value in (
                ("num_requests_running", "Sequences in the running batch", stats.num_running),
                ("num_requests_waiting", "Queued or preempted requests", stats.num_waiting),
                ("num_requests_swapped", "Requests whose KV sits in host swap", stats.num_swapped),
                ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", stats.kv_usage),
                ("kv_cache_used_blocks", "KV blocks in use", stats.num_used_blocks),
                ("kv_cache_total_blocks", "KV blocks in the pool", stats.num_total_blocks),
                ("prefix_cache_hit_rate", "Prefix-cache hits / queries since start",
                 stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0),
                ("num_streams_open", "Requests with a live consumer", self.front.num_in_flight),
                ("draining", "1 while shutting down", float(self.front.draining))):
            yield GaugeMetricFamily(f"everystop:{name}", doc, value=value)
        for name, doc, value in (
                ("prefix_cache_queries", "Prefix-cache lookups (tokens)", stats.prefix_queries),
                ("prefix_cache_hits", "Prefix-cache hits (tokens)", stats.prefix_hits),
                ("watchdog_aborts", "Sequences freed by the watchdog",
                 self.front.num_watchdog_aborts)):
            yield CounterMetricFamily(f"everystop:{name}", doc, value=value)
        yield from _step_budget_metrics(stats)
        yield from _memory_metrics(self.front)
        pre = CounterMetricFamily("everystop:num_preemptions", "Preemptions by strategy",
                                  labels=["strategy"])
        pre.add_metric(["recompute"], stats.num_preemptions_recompute)
        pre.add_metric(["swap"], stats.num_preemptions_swap)
        yield pre


def _memory_metrics(front: AsyncEngine) -> Iterator[Any]:
    """Process RSS (read at scrape time) and the model weights' bytes as held (quantized
    weights count their blocks; absent for executors without a model)."""
    rss = 0
    try:
        with open("/proc/self/status") as f:
            rss = next((int(line.split()[1]) * 1024 for line in f
                        if line.startswith("VmRSS:")), 0)
    except OSError:  # not Linux
        pass
    yield GaugeMetricFamily("everystop:process_resident_memory_bytes",
                            "Resident set size of the server process", value=rss)
    weight_bytes = getattr(getattr(front.engine, "executor", None), "weight_bytes", None)
    if isinstance(weight_bytes, int):
        yield GaugeMetricFamily("everystop:model_weight_bytes",
                                "Bytes of the model weights as held in memory",
                                value=weight_bytes)


def _step_budget_metrics(stats: SchedulerStats) -> Iterator[Any]:
    """The step budget: fitted step cost, the last measured pass against its prediction, and
    the prefill tokens the TPOT target left after the last pass's decodes."""
    coeffs = GaugeMetricFamily("everystop_step_cost_coefficient_seconds",
                               "Fitted step cost per unit of each term", labels=["term"])
    for term, value in stats.step_cost.items():
        coeffs.add_metric([term], value)
    yield coeffs
    for name, doc, value in (
            ("step_cost_predicted_seconds", "Predicted time of the last measured step",
             stats.step_predicted_s),
            ("step_cost_measured_seconds", "Measured time of the last step",
             stats.step_measured_s),
            ("step_cost_auto_tpot_target_seconds", "TPOT target used where none is set",
             stats.auto_tpot_target_s),
            ("prefill_budget_tokens", "Prefill tokens the last step's target left after its "
             "decodes", stats.prefill_budget_tokens)):
        yield GaugeMetricFamily(f"everystop_{name}", doc, value=value)
