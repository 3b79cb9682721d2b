"""Per-LoRA-adapter metrics: vLLM's `lora_requests_info` (the adapters of the running and the
waiting requests, as comma-separated label values, and max_lora; the value is the time of the
scrape, as vLLM sets it) and our own counters of finished requests, prompt and generated tokens
and an end-to-end latency histogram, each labelled `lora_name`.

The `lora_name` label set is bounded: adapter names are the operator's (`--lora`, and the
operator-only load route); requests on the base model are not counted here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from everystop.core.outputs import RequestOutput
from everystop.core.request import Request
from everystop.engine.client import EngineClient

_LABELS = ["lora_name"]


class LoraMetrics:
    def __init__(self, registry: CollectorRegistry, latency_buckets: tuple[float, ...]) -> None:
        r = registry
        self.requests = Counter("everystop:lora_requests", "Finished requests per LoRA adapter",
                                _LABELS, registry=r)
        self.prompt_tokens = Counter("everystop:lora_prompt_tokens",
                                     "Prompt tokens of finished requests per LoRA adapter",
                                     _LABELS, registry=r)
        self.generation_tokens = Counter("everystop:lora_generation_tokens",
                                         "Tokens generated per LoRA adapter", _LABELS,
                                         registry=r)
        self.e2e = Histogram("everystop:lora_e2e_request_latency_seconds",
                             "Arrival to finish, per LoRA adapter", _LABELS,
                             buckets=latency_buckets, registry=r)
        # The same counts for the live page (/dashboard/data), per adapter.
        self._totals: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def totals(self) -> dict[str, dict[str, int]]:
        """Per adapter name: finished requests and generated tokens since start."""
        with self._lock:
            return {name: dict(t) for name, t in self._totals.items()}

    def on_finished(self, req: Request, out: RequestOutput) -> None:
        name = req.lora_name
        if name is None:
            return
        self.requests.labels(name).inc()
        self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(name).inc(len(out.token_ids))
        with self._lock:
            t = self._totals.setdefault(name, {"requests": 0, "generation_tokens": 0})
            t["requests"] += 1
            t["generation_tokens"] += len(out.token_ids)
        m = out.metrics
        if m is not None and m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)


class LoraInfoCollector(Collector):
    """`everystop:lora_requests_info` (vLLM's `vllm:lora_requests_info`), read at scrape time;
    absent while the server serves no adapter and no request uses one."""

    def __init__(self, front: EngineClient) -> None:
        self.front = front

    def collect(self) -> Iterator[Any]:
        stats = self.front.stats()
        running, waiting = stats.running_lora_adapters, stats.waiting_lora_adapters
        if not (running or waiting or self.front.lora_adapters()):
            return
        info = GaugeMetricFamily(
            "everystop:lora_requests_info", "LoRA adapters of the running and the waiting "
            "requests (comma-separated), and the cap on adapters running at once (0: none); "
            "the value is the scrape's Unix time",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(running), ",".join(waiting), str(stats.max_loras)],
                        time.time())
        yield info
