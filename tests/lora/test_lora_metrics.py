"""Per-adapter metrics on /metrics: vLLM's lora_requests_info gauge (under vLLM's name with
--metrics-names vllm) and our per-adapter request, token and latency series, labelled by the
adapter's name; requests on the base model are not counted there."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from everystop.engine.async_engine import AsyncEngine
from everystop.sampling_params import SamplingParams
from everystop.server.app import build_app
from everystop.server.dashboard import install_dashboard
from everystop.server.lora_metrics import LoraInfoCollector
from everystop.server.metrics import ServerMetrics

from .test_lora_admin import _engine

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _labelled(samples: Samples, name: str) -> dict[str, float]:
    """`name`'s value per lora_name."""
    return {dict(labels)["lora_name"]: v for (n, labels), v in samples.items() if n == name}


@pytest.fixture(scope="module")
def served(lora_dirs) -> Iterator[tuple[TestClient, ServerMetrics]]:
    base, adapters = lora_dirs
    front = AsyncEngine(_engine(base, lora_modules=(("all7", adapters["all7"]),
                                                    ("qv", adapters["qv"])), max_lora_rank=8))
    metrics = ServerMetrics(metric_names="both")
    try:
        with TestClient(build_app(front, "tiny-base", metrics=metrics)) as c:
            yield c, metrics
    finally:
        front.shutdown()


def test_per_adapter_requests_tokens_and_latency(served):
    client, _ = served
    usage: dict[str, list[int]] = {"all7": [0, 0], "qv": [0, 0]}
    for model, prompt, n in (("all7", "one", 3), ("all7", "second one", 5), ("qv", "x", 2),
                             ("tiny-base", "base only", 4)):
        r = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                 "max_tokens": n, "temperature": 0})
        assert r.status_code == 200, r.text
        if model in usage:
            usage[model][0] += r.json()["usage"]["prompt_tokens"]
            usage[model][1] += r.json()["usage"]["completion_tokens"]
    got = _parse(client.get("/metrics").text)
    assert _labelled(got, "everystop:lora_requests_total") == {"all7": 2, "qv": 1}
    assert _labelled(got, "everystop:lora_prompt_tokens_total") == {
        name: u[0] for name, u in usage.items()}
    assert _labelled(got, "everystop:lora_generation_tokens_total") == {
        name: u[1] for name, u in usage.items()}
    assert _labelled(got, "everystop:lora_e2e_request_latency_seconds_count") == {
        "all7": 2, "qv": 1}
    assert all(v > 0 for v in _labelled(got, "everystop:lora_e2e_request_latency_seconds_sum")
               .values())
    # Every series carries the served model's name, as the rest of /metrics.
    assert all(dict(labels)["model_name"] == "tiny-base"
               for (name, labels) in got if name.startswith("everystop:lora_requests"))


def test_lora_requests_info_under_both_names_when_idle(served):
    client, _ = served
    got = _parse(client.get("/metrics").text)
    for name in ("everystop:lora_requests_info", "vllm:lora_requests_info"):
        (labels,) = [dict(labels) for (n, labels) in got if n == name]
        assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"],
                labels["max_lora"]) == ("", "", "0")


def test_lora_requests_info_names_running_and_waiting_adapters(lora_dirs):
    base, adapters = lora_dirs
    engine = _engine(base, lora_modules=tuple((n, adapters[n]) for n in ("all7", "qv", "kod")),
                     max_lora_rank=16)
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_loras=1)
    registry = CollectorRegistry()
    registry.register(LoraInfoCollector(engine))  # type: ignore[arg-type]

    def info() -> tuple[str, str, str]:
        (labels,) = [dict(labels) for (n, labels) in
                     _parse(generate_latest(registry).decode())
                     if n == "everystop:lora_requests_info"]
        return labels["running_lora_adapters"], labels["waiting_lora_adapters"], \
            labels["max_lora"]

    for name in ("qv", "all7", "qv", None):
        engine.add_request(engine.make_request([5, 6, 7], SamplingParams(max_tokens=3),
                                               lora=name))
    assert info() == ("", "all7,qv", "1")
    engine.step()
    # --max-loras 1: all7 waits for qv's request to finish, and the second qv behind it
    assert info() == ("qv", "all7,qv", "1")
    while engine.has_work():
        engine.step()
    assert info() == ("", "", "1")


def test_a_server_without_adapters_has_no_lora_series(lora_dirs):
    front = AsyncEngine(_engine(lora_dirs[0]))
    try:
        with TestClient(build_app(front, "tiny-base")) as client:
            assert client.post("/v1/completions", json={"prompt": "hi",
                                                        "max_tokens": 2}).status_code == 200
            text = client.get("/metrics").text
    finally:
        front.shutdown()
    assert [name for (name, _) in _parse(text) if "lora" in name] == []


def test_the_live_page_data_counts_requests_per_adapter(lora_dirs):
    base, adapters = lora_dirs
    front = AsyncEngine(_engine(base, lora_modules=(("qv", adapters["qv"]),)))
    metrics = ServerMetrics()
    app = build_app(front, "tiny-base", metrics=metrics, admin_key="k",
                    extensions=[lambda app, f: install_dashboard(app, f, metrics)])
    try:
        with TestClient(app, headers={"X-Admin-Key": "k"}) as client:
            for model in ("qv", "qv", "tiny-base"):
                assert client.post("/v1/completions", json={
                    "model": model, "prompt": "page", "max_tokens": 3}).status_code == 200
            lora = client.get("/dashboard/data").json()["lora"]
    finally:
        front.shutdown()
    assert lora == {"served": ["qv"], "running": [], "waiting": [], "max_loras": 0,
                    "adapters": {"qv": {"requests": 2, "generation_tokens": 6}}}
