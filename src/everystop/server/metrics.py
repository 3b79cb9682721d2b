"""Prometheus metrics under vLLM's names and units (`everystop:*` for `vllm:*`), on a private
registry; docs/metrics.md maps every series to vLLM's.

Three sources feed them:
  - engine listeners (engine thread): per-iteration latency and token counts, and per finished
    request its TTFT, TPOT, queue/prefill/decode/inference/end-to-end times and token counts;
  - the routes (event loop): inter-token latency as tokens reach the client, 429s by reason;
    the event loop's own lag (server/loop_lag.py);
  - a collector read at scrape time: queue lengths, KV usage, prefix-cache and preemption
    counters straight from the scheduler, so they are never stale.

Every series carries `model_name` (vLLM's dashboards filter on it): it is added at scrape time
to whatever sits on `registry`, the guardrail and telemetry collectors included. Request series
carry `tier` (the priority tier, 0 = premium) and `tenant`. Tenant labels are bounded: the first
`max_tenants` tenants seen keep their name, any later one is reported as "other" (an unbounded
label set would grow the registry without limit).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from everystop.core.outputs import IterationRecord, RequestOutput, SchedulerOutput, SchedulerStats
from everystop.core.request import Request
from everystop.engine.client import EngineClient
from everystop.server.heap_trim import HEAP_TRIMMER
from everystop.server.live_window import LiveWindow
from everystop.server.lora_metrics import LoraInfoCollector, LoraMetrics
from everystop.server.metrics_names import MetricNames, renamed
from everystop.server.runtime_stats import gc_pause_metrics, install_gc_pause_recorder
from everystop.server.tenants import clean_tenant

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_REQUEST = ["tier", "tenant"]

logger = logging.getLogger(__name__)


class TenantLabels:
    """Maps tenant ids to a bounded set of label values."""

    def __init__(self, max_tenants: int = 20) -> None:
        self.max_tenants = max_tenants
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        tenant = clean_tenant(tenant)
        with self._lock:
            if tenant in self._known:
                return tenant
            if len(self._known) < self.max_tenants:
                self._known.add(tenant)
                return tenant
        return "other"


class ServerMetrics:
    """Args:
        model_name: the `model_name` label value (the served name; `attach` may set it).
        max_tenants: tenants that keep their own label value.
    """

    def __init__(self, max_tenants: int = 20, model_name: str = "unknown",
                 metric_names: MetricNames = "everystop") -> None:
        self.registry = CollectorRegistry()  # where every collector registers
        install_gc_pause_recorder()
        self.model_name = model_name
        self._exposed = CollectorRegistry(auto_describe=False)
        self._exposed.register(_WithModelName(self.registry, lambda: self.model_name,
                                              metric_names))
        self.tenant_label = TenantLabels(max_tenants)
        # The live page's recent samples, fed by the same events as the histograms.
        self.window = LiveWindow()
        r = self.registry

        def latency(name: str, doc: str, labels: list[str] = _REQUEST) -> Histogram:
            return Histogram(f"everystop:{name}", doc, labels, buckets=_LATENCY_BUCKETS,
                             registry=r)

        def tokens(name: str, doc: str, labels: list[str] = _REQUEST) -> Histogram:
            return Histogram(f"everystop:{name}", doc, labels, buckets=_TOKEN_BUCKETS,
                             registry=r)

        self.ttft = latency("time_to_first_token_seconds", "Arrival to first token")
        self.tpot = latency("time_per_output_token_seconds",
                            "Per request: first token to finish over the tokens after the first")
        self.itl = latency("inter_token_latency_seconds",
                           "Time between tokens reaching the client (one sample per token)")
        self.e2e = latency("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = latency("request_queue_time_seconds", "Arrival to first scheduled")
        self.inference_time = latency("request_inference_time_seconds",
                                      "First scheduled to finish")
        self.prefill_time = latency("request_prefill_time_seconds",
                                    "First scheduled to first token")
        self.decode_time = latency("request_decode_time_seconds", "First token to finish")
        self.request_prompt_tokens = tokens("request_prompt_tokens", "Prompt tokens per request")
        self.request_generation_tokens = tokens("request_generation_tokens",
                                                "Generated tokens per request")
        self.iteration_latency = latency("iteration_latency_seconds", "One engine step", [])
        self.iteration_tokens = tokens("iteration_tokens_total",
                                       "Tokens (prefill + decode) per engine step", [])
        self.prefill_tokens_iter = tokens("iteration_prefill_tokens",
                                          "Prefill tokens per engine step", [])
        self.decode_tokens_iter = tokens("iteration_decode_tokens",
                                         "Decode tokens per engine step", [])
        self.request_success = Counter("everystop:request_success", "Finished requests",
                                       ["finished_reason", "tier"], registry=r)
        self.prompt_tokens = Counter("everystop:prompt_tokens", "Prompt tokens processed",
                                     _REQUEST, registry=r)
        self.generation_tokens = Counter("everystop:generation_tokens", "Tokens generated",
                                         _REQUEST, registry=r)
        self.rejected = Counter("everystop:requests_rejected", "429 answers by reason",
                                ["reason", "tier"], registry=r)
        self.ignored_fields = Counter(
            "everystop:ignored_request_fields", "Bookkeeping keys in messages accepted and "
            "ignored (server/fields.py MESSAGE_BOOKKEEPING), by key", ["field"], registry=r)
        self.loop_lag = Histogram("everystop:event_loop_lag_seconds",
                                  "How late the event loop woke a sleeping task (sampled every "
                                  "100 ms): the stall every stream and /health saw",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.lora = LoraMetrics(r, _LATENCY_BUCKETS)
        # Fed each loop-lag sample after the histogram (the guardrails' loop_lag alert).
        self.loop_lag_listeners: list[Callable[[float], None]] = []

    def attach(self, async_engine: EngineClient, model_name: str | None = None) -> None:
        """Hook the engine's listeners and the scrape-time collector."""
        if model_name is not None:
            self.model_name = model_name
        async_engine.add_listeners(self.on_iteration, self.on_finished)
        self.registry.register(_EngineCollector(async_engine))
        self.registry.register(LoraInfoCollector(async_engine))

    # -- engine thread ---------------------------------------------------------------------------
    def on_iteration(self, record: IterationRecord, _: SchedulerOutput) -> None:
        self.iteration_latency.observe(record.latency_s)
        self.iteration_tokens.observe(record.num_prefill_tokens + record.num_decode_tokens)
        self.prefill_tokens_iter.observe(record.num_prefill_tokens)
        self.decode_tokens_iter.observe(record.num_decode_tokens)
        self.window.on_iteration(record)

    def on_finished(self, req: Request, out: RequestOutput) -> None:
        tier, tenant = str(req.priority), self.tenant_label(req.tenant)
        num_prompt, num_generated = len(out.prompt_token_ids), len(out.token_ids)
        m = out.metrics
        tpot = None
        if m is not None:
            if m.ttft_s is not None:
                self.ttft.labels(tier, tenant).observe(m.ttft_s)
            if m.queue_wait_s is not None:
                self.queue_time.labels(tier, tenant).observe(m.queue_wait_s)
            done, first, admitted = m.finished_time, m.first_token_time, m.admitted_time
            if done is not None:
                self.e2e.labels(tier, tenant).observe(done - m.arrival_time)
            if admitted is not None and first is not None:
                self.prefill_time.labels(tier, tenant).observe(first - admitted)
            if admitted is not None and done is not None:
                self.inference_time.labels(tier, tenant).observe(done - admitted)
            if first is not None and done is not None:
                self.decode_time.labels(tier, tenant).observe(done - first)
                if num_generated > 1:
                    tpot = (done - first) / (num_generated - 1)
                    self.tpot.labels(tier, tenant).observe(tpot)
        self.request_prompt_tokens.labels(tier, tenant).observe(num_prompt)
        self.request_generation_tokens.labels(tier, tenant).observe(num_generated)
        self.request_success.labels(out.finish_reason or "abort", tier).inc()
        self.prompt_tokens.labels(tier, tenant).inc(num_prompt)
        self.generation_tokens.labels(tier, tenant).inc(num_generated)
        self.window.on_finished(tenant, req.priority, m, tpot, num_generated)
        self.lora.on_finished(req, out)

    # -- event loop -----------------------------------------------------------------------------
    def observe_itl(self, priority: int, tenant: str, gap_s: float, num_tokens: int) -> None:
        label = self.tenant_label(tenant)
        child = self.itl.labels(str(priority), label)
        per_token = gap_s / max(1, num_tokens)
        for _ in range(num_tokens):
            child.observe(per_token)
        self.window.on_itl(label, priority, per_token, num_tokens)

    def observe_loop_lag(self, lag_s: float) -> None:
        self.loop_lag.observe(lag_s)
        for listener in self.loop_lag_listeners:
            listener(lag_s)

    def count_rejected(self, reason: str, priority: int) -> None:
        self.rejected.labels(reason, str(priority)).inc()
        self.window.on_rejected(reason, priority)

    def count_ignored_fields(self, names: list[str]) -> None:
        """The label set is bounded: only names from fields.py's fixed lists reach here."""
        for name in names:
            self.ignored_fields.labels(name).inc()
        if names:
            logger.debug("ignored request fields: %s", ", ".join(sorted(set(names))))

    def render(self) -> bytes:
        return generate_latest(self._exposed)


class _WithModelName(Collector):
    """Everything on `inner`, each sample labelled with the served model's name, under the
    names `names` asks for (server/metrics_names.py)."""

    def __init__(self, inner: CollectorRegistry, model_name: Any,
                 names: MetricNames = "everystop") -> None:
        self.inner = inner
        self.model_name = model_name
        self.names = names

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        name = self.model_name()
        # Fresh objects on every collect: safe to edit.
        for family in renamed(self.inner.collect(), self.names):
            family.samples = [s._replace(labels={"model_name": name, **s.labels})
                              for s in family.samples]
            yield family


class _EngineCollector(Collector):
    """Scheduler state read at scrape time (plain attribute reads; no engine lock)."""

    def __init__(self, async_engine: EngineClient) -> None:
        self.front = async_engine

    def collect(self) -> Iterator[Any]:
        stats = self.front.stats()
        for name, doc, value in (
                ("num_requests_running", "Sequences in the running batch", stats.num_running),
                ("num_requests_waiting", "Queued or preempted requests", stats.num_waiting),
                ("num_requests_swapped", "Requests whose KV sits in host swap", stats.num_swapped),
                ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", stats.kv_usage),
                ("host_kv_cache_usage_perc", "Fraction of host swap blocks in use (0-1)",
                 host_kv_usage(stats)),
                ("kv_cache_used_blocks", "KV blocks in use", stats.num_used_blocks),
                ("kv_cache_total_blocks", "KV blocks in the pool", stats.num_total_blocks),
                ("kv_cache_watermark_perc", "Fraction of KV blocks admissions leave free (0-1)",
                 self.front.cache_config.watermark),
                ("prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens since start",
                 prefix_hit_rate(stats)),
                ("num_streams_open", "Requests with a live consumer", self.front.num_in_flight),
                ("draining", "1 while shutting down", float(self.front.draining))):
            yield GaugeMetricFamily(f"everystop:{name}", doc, value=value)
        for name, doc, value in (
                ("prefix_cache_queries", "Prefix-cache queried tokens (admitted requests)",
                 stats.prefix_query_tokens),
                ("prefix_cache_hits", "Prefix-cache hit tokens (served from cached blocks)",
                 stats.prefix_hit_tokens),
                ("kv_swap_out_blocks", "KV blocks copied to host swap", stats.swap_out_blocks),
                ("kv_swap_in_blocks", "KV blocks copied back from host swap",
                 stats.swap_in_blocks),
                ("watchdog_aborts", "Sequences freed by the watchdog",
                 self.front.num_watchdog_aborts),
                ("spec_decode_num_drafts", "Speculating rows verified (passes x sequences)",
                 stats.spec_decode_num_drafts),
                ("spec_decode_num_draft_tokens", "Speculative tokens proposed and verified",
                 stats.spec_decode_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Speculative tokens the model accepted",
                 stats.spec_decode_num_accepted_tokens)):
            yield CounterMetricFamily(f"everystop:{name}", doc, value=value)
        yield from _spec_decode_metrics(stats)
        yield from _step_budget_metrics(stats)
        yield from _memory_metrics(self.front)
        pre = CounterMetricFamily("everystop:num_preemptions", "Preemptions by strategy",
                                  labels=["strategy"])
        pre.add_metric(["recompute"], stats.num_preemptions_recompute)
        pre.add_metric(["swap"], stats.num_preemptions_swap)
        yield pre


def _spec_decode_metrics(stats: SchedulerStats) -> Iterator[Any]:
    """Speculative decoding's acceptance: overall, and by proposal position (position 0 is
    the first proposal after a sequence's last token; a later one is kept only if all before
    it were)."""
    yield GaugeMetricFamily("everystop:spec_decode_draft_acceptance_rate",
                            "Accepted over proposed speculative tokens since start (0-1)",
                            value=stats.spec_decode_acceptance_rate)
    per_pos = CounterMetricFamily("everystop:spec_decode_num_accepted_tokens_per_pos",
                                  "Speculative tokens accepted at each proposal position",
                                  labels=["position"])
    for pos, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
        per_pos.add_metric([str(pos)], count)
    yield per_pos
    # The sizing rule's choices (core/spec_sizing.py).
    yield GaugeMetricFamily("everystop:spec_decode_mean_k",
                            "Mean proposals per speculating sequence chosen by the sizing "
                            "rule in the latest pass", value=stats.spec_decode_mean_k)
    yield CounterMetricFamily("everystop:spec_decode_num_sized_off",
                              "Speculating sequence-passes sized to no proposal (plain "
                              "decoding predicted faster)", value=stats.spec_decode_num_sized_off)


def prefix_hit_rate(stats: SchedulerStats) -> float:
    """Hit tokens over queried tokens since start (0 before the first lookup)."""
    return stats.prefix_hit_tokens / stats.prefix_query_tokens if stats.prefix_query_tokens \
        else 0.0


def host_kv_usage(stats: SchedulerStats) -> float:
    """Host swap blocks in use over the swap pool (0 without swap space)."""
    return stats.num_host_used_blocks / stats.num_host_blocks if stats.num_host_blocks \
        else 0.0


def _memory_metrics(front: EngineClient) -> Iterator[Any]:
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
    memory = front.memory()  # none of its own on a cluster's ingress: its replicas report theirs
    if memory.weight_bytes is not None:
        yield GaugeMetricFamily("everystop:model_weight_bytes",
                                "Bytes of the model weights as held in memory",
                                value=memory.weight_bytes)
    if memory.kv_pool_resident_bytes is not None:
        yield GaugeMetricFamily("everystop:kv_pool_resident_bytes",
                                "Resident bytes of the KV pools in this process's memory (they "
                                "are allocated untouched; pages arrive as blocks are first used)",
                                value=memory.kv_pool_resident_bytes)
    yield from gc_pause_metrics()
    yield from HEAP_TRIMMER.metrics()


def _step_budget_metrics(stats: SchedulerStats) -> Iterator[Any]:
    """The step budget: fitted step cost, the last measured pass against its prediction, and
    the prefill tokens the TPOT target left after the last pass's decodes."""
    coeffs = GaugeMetricFamily("everystop:step_cost_coefficient_seconds",
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
        yield GaugeMetricFamily(f"everystop:{name}", doc, value=value)
