"""/metrics, scraped after a load run, agrees with what the clients saw: successes, tokens, 429s."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from everystop.config import CacheConfig, EngineConfig, SchedulerConfig
from everystop.engine.async_engine import AsyncEngine
from everystop.engine.llm_engine import LLMEngine
from everystop.server.admin import install_admin_routes, install_telemetry
from everystop.server.app import build_app
from everystop.server.metrics import ServerMetrics
from tests.server.fakes import ChatCharTokenizer, SlowToyExecutor


def _sum(families: dict, name: str, **labels: str) -> float:
    total = 0.0
    for sample in families.get(name, []):
        if sample.name.endswith("_created"):
            continue
        if all(sample.labels.get(k) == v for k, v in labels.items()):
            total += sample.value
    return total


def test_metrics_match_client_view() -> None:
    config = EngineConfig(cache=CacheConfig(block_size=4, watermark=0.0),
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                                    chunk_size=16, max_queued_per_tenant=3))
    # 50 ms a step: a request holds its seat for >= 200 ms, so the 16, all sent at once, meet a
    # full tenant queue even when a loaded host takes tens of ms to take in each one (at 10 ms
    # a step the seats could drain as fast as the requests came, and none was turned away).
    engine = LLMEngine(config, SlowToyExecutor(256, 4, step_delay_s=0.05), ChatCharTokenizer())
    front = AsyncEngine(engine)
    metrics = ServerMetrics()

    def observability(app, fe) -> None:
        tel = install_telemetry(app, fe, db=None, registry=metrics.registry)
        install_admin_routes(app, fe, store=tel.store)

    app = build_app(front, "toy", admin_key="k", metrics=metrics, extensions=[observability])

    async def run() -> tuple[list[httpx.Response], str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://toy") as client:
            async def one(i: int) -> httpx.Response:
                return await client.post(
                    "/v1/completions", headers={"X-Tenant-Id": "acme"},
                    json={"model": "toy", "prompt": f"request {i}", "max_tokens": 4 + i % 5,
                          "ignore_eos": True, "temperature": 0})
            responses = await asyncio.gather(*(one(i) for i in range(16)))
            scrape = (await client.get("/metrics")).text
        return list(responses), scrape

    try:
        responses, scrape = asyncio.run(run())
    finally:
        front.shutdown()
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(limited) == 16
    assert ok and limited, "the tenant cap should have turned some requests away"
    assert all("retry-after" in r.headers for r in limited)
    families = {s.name: [] for f in text_string_to_metric_families(scrape) for s in f.samples}
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            families[sample.name].append(sample)
    usage = [r.json()["usage"] for r in ok]
    assert _sum(families, "everystop:request_success_total") == len(ok)
    assert _sum(families, "everystop:generation_tokens_total") == sum(
        u["completion_tokens"] for u in usage)
    assert _sum(families, "everystop:prompt_tokens_total") == sum(
        u["prompt_tokens"] for u in usage)
    assert _sum(families, "everystop:requests_rejected_total") == len(limited)
