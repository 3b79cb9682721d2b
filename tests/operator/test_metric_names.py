"""The exported series under vLLM's names and units, with model_name on every one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from everystop.server.metrics import ServerMetrics
from tests.telemetry.helpers import make_engine, params, run


def _scrape(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(metrics.render().decode())
            for s in f.samples}


def _attached(eng: object, name: str = "m") -> ServerMetrics:
    metrics = ServerMetrics()
    # What ServerMetrics reads of an AsyncEngine, served by the LLMEngine underneath.
    metrics.attach(SimpleNamespace(  # type: ignore[arg-type]
        add_listeners=eng.add_listeners, stats=eng.stats,  # type: ignore[attr-defined]
        memory=eng.memory,  # type: ignore[attr-defined]
        cache_config=eng.config.cache, num_in_flight=0,  # type: ignore[attr-defined]
        draining=False, num_watchdog_aborts=0,
        lora_adapters=eng.lora_adapters), model_name=name)  # type: ignore[attr-defined]
    return metrics


def test_prefix_cache_counters_count_tokens_not_lookups() -> None:
    eng = make_engine(block_size=4)
    metrics = _attached(eng)
    shared = "s" * 16  # four full blocks every later request finds cached
    eng.add_request(shared + "a" * 5, params(2))
    run(eng)
    for tail in "bcde":
        eng.add_request(shared + tail * 5, params(2))
    run(eng)
    got = _scrape(metrics)
    queried = got[("everystop:prefix_cache_queries_total", (("model_name", "m"),))]
    hits = got[("everystop:prefix_cache_hits_total", (("model_name", "m"),))]
    assert queried == 5 * 21  # every admitted request's tokens
    assert hits == 4 * 16  # the four later requests each reused the 16 shared tokens
    assert got[("everystop:prefix_cache_hit_rate", (("model_name", "m"),))] == \
        pytest.approx(64 / 105)


def test_request_series_have_vllm_names_units_and_labels() -> None:
    eng = make_engine()
    metrics = _attached(eng, "llama")
    eng.add_request("x" * 10, params(5), priority=0, tenant="acme")
    eng.add_request("y" * 7, params(3), priority=2, tenant="zeta")
    run(eng)
    got = _scrape(metrics)
    assert all(dict(labels)["model_name"] == "llama" for _, labels in got)
    acme = (("model_name", "llama"), ("tenant", "acme"), ("tier", "0"))
    zeta = (("model_name", "llama"), ("tenant", "zeta"), ("tier", "2"))
    # token histograms count tokens (their sum is the request's tokens)
    assert got[("everystop:request_prompt_tokens_sum", acme)] == 10
    assert got[("everystop:request_generation_tokens_sum", acme)] == 5
    assert got[("everystop:request_generation_tokens_sum", zeta)] == 3
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_queue_time_seconds", "request_inference_time_seconds",
                 "e2e_request_latency_seconds"):
        assert got[(f"everystop:{name}_count", acme)] == 1, name
    # decode + prefill + queue = end to end (seconds, one request)
    parts = sum(got[(f"everystop:{n}_sum", zeta)] for n in (
        "request_queue_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds"))
    assert parts == pytest.approx(got[("everystop:e2e_request_latency_seconds_sum", zeta)])
    assert got[("everystop:generation_tokens_total", acme)] == 5
    assert got[("everystop:request_success_total",
                (("finished_reason", "length"), ("model_name", "llama"), ("tier", "2")))] == 1
    # the step-cost gauges share the one prefix
    assert not [n for n, _ in got if not n.startswith("everystop:")]
