"""`--metrics-names`: which names /metrics gives the series that vLLM also exports.

`everystop` (the default) names every series `everystop:*`. `vllm` names those vLLM has under
vLLM's names (`vllm:*`, with vLLM's aliases such as `gpu_cache_usage_perc`), so vLLM's Grafana
dashboards and alerts work unchanged; the rest keep ours. `both` exports them twice, under
each name. Units, labels (`model_name`, and `finished_reason` on request_success) and values
are the same either way: ours were modelled on vLLM's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any, Literal

MetricNames = Literal["everystop", "vllm", "both"]
METRIC_NAMES: tuple[MetricNames, ...] = ("everystop", "vllm", "both")

OURS, VLLM = "everystop:", "vllm:"
# Our family name (without the prefix) -> vLLM's names for the same series.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "num_requests_swapped": ("num_requests_swapped",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    # vLLM's older dashboards plot its host (CPU) swap pool beside the device's.
    "host_kv_cache_usage_perc": ("cpu_cache_usage_perc",),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "num_preemptions": ("num_preemptions",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
    "spec_decode_draft_acceptance_rate": ("spec_decode_draft_acceptance_rate",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "iteration_tokens_total": ("iteration_tokens_total",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "time_per_output_token_seconds": ("time_per_output_token_seconds",
                                      "request_time_per_output_token_seconds"),
    "inter_token_latency_seconds": ("inter_token_latency_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_inference_time_seconds": ("request_inference_time_seconds",),
    "request_prefill_time_seconds": ("request_prefill_time_seconds",),
    "request_decode_time_seconds": ("request_decode_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    # The server fans `n` out into one engine request per choice: each request is its own
    # "sequence group", whose longest sequence is its generation.
    "request_generation_tokens": ("request_generation_tokens",
                                  "request_max_num_generation_tokens"),
    "request_success": ("request_success",),
    "lora_requests_info": ("lora_requests_info",),
}


def renamed(families: Iterable[Any], names: MetricNames) -> Iterator[Any]:
    """`families` (prometheus_client Metric objects, fresh from a collect) under `names`."""
    for family in families:
        ours = family.name.removeprefix(OURS)
        aliases = VLLM_NAMES.get(ours, ()) if family.name.startswith(OURS) else ()
        if names != "vllm" or not aliases:
            yield family
        if names == "everystop":
            continue
        for alias in aliases:
            yield _as(family, VLLM + alias)


def _as(family: Any, name: str) -> Any:
    """A copy of `family` named `name`, its samples' suffixes (_total, _bucket, ...) kept."""
    out = copy.copy(family)
    old = family.name
    out.name = name
    out.samples = [s._replace(name=name + s.name[len(old):]) for s in family.samples]
    return out
