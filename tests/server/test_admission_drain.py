"""Backpressure (429 + Retry-After), auth (401) and SIGTERM draining (503, then exit 0), each
against its own toy server subprocess."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from .conftest import start_toy_server

pytestmark = pytest.mark.server


def _wait_for(pred, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_api_key_required_when_set(tmp_path: Path) -> None:
    server = start_toy_server(tmp_path, "--api-key", "s3cret")
    try:
        body = {"model": "toy", "prompt": "a", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=10)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=10,
                       headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # no key needed
    finally:
        server.stop()


def test_tenant_queue_cap_and_tier_wait_threshold_answer_429(tmp_path: Path) -> None:
    # Tenant A's requests take 1000 steps of >= 20 ms: still running and queued however slowly
    # this client gets to its checks on a loaded host (they are cancelled at the end).
    server = start_toy_server(tmp_path, "--step-delay", "0.02", "--max-num-seqs", "1",
                              "--max-num-batched-tokens", "64", "--max-queued-per-tenant", "2",
                              "--max-queue-wait", "0,0,0.5", "--max-model-len", "1100")

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            def post(tenant: str, priority: int = 1, max_tokens: int = 1000):  # type: ignore
                return http.post("/v1/completions", headers={"X-Tenant-Id": tenant},
                                 json={"model": "toy", "prompt": "q", "max_tokens": max_tokens,
                                       "priority": priority})

            warm = await post("warm", max_tokens=1)  # one completion: a rate to estimate from
            assert warm.status_code == 200
            # Tenant A: one running and two queued fill its queue.
            tasks = [asyncio.ensure_future(post("A"))]
            for _ in range(200):  # (submitted together, the third could meet two queued)
                if server.metric("everystop:num_requests_running") == 1:
                    break
                await asyncio.sleep(0.02)
            tasks += [asyncio.ensure_future(post("A")) for _ in range(2)]
            for _ in range(200):
                if server.metric("everystop:num_requests_waiting") == 2:
                    break
                await asyncio.sleep(0.02)
            assert server.metric("everystop:num_requests_waiting") == 2
            full = await post("A")
            assert full.status_code == 429, full.text
            assert int(full.headers["Retry-After"]) >= 1
            assert full.json()["error"]["type"] == "rate_limit_error"
            # Best-effort tier would wait for three ~20 s requests: over its 0.5 s threshold.
            slow = await post("B", priority=2)
            assert slow.status_code == 429 and slow.json()["error"]["code"] == \
                "queue_wait_exceeded"
            assert int(slow.headers["Retry-After"]) >= 1
            # Tier 0 has no threshold and tenant B no queue yet: admitted.
            ok = asyncio.ensure_future(post("B", priority=0, max_tokens=2))
            for t in tasks:
                t.cancel()  # the three A requests leave; their slots free
            await asyncio.gather(*tasks, return_exceptions=True)
            assert (await ok).status_code == 200
        text = httpx.get(server.url + "/metrics", timeout=5).text
        assert ('everystop:requests_rejected_total{model_name="toy",reason="tenant_queue",'
                'tier="1"} 1.0') in text
        assert ('everystop:requests_rejected_total{model_name="toy",reason="expected_wait",'
                'tier="2"} 1.0') in text

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        server.stop()


def test_sigterm_drains_then_exits_zero(tmp_path: Path) -> None:
    # The short stream needs 40 steps of >= 20 ms (0.8 s) within the 3 s grace, so a loaded
    # host may take 75 ms a step; the long one 1000 (>= 20 s), so it cannot finish in it.
    server = start_toy_server(tmp_path, "--step-delay", "0.02", "--grace-period", "3",
                              "--max-model-len", "1100")
    results: dict[str, object] = {}

    async def stream(name: str, max_tokens: int) -> None:
        body = {"model": "toy", "prompt": name, "max_tokens": max_tokens, "stream": True}
        async with (httpx.AsyncClient(base_url=server.url, timeout=30) as http,
                    http.stream("POST", "/v1/completions", json=body) as r):
            frames = [json.loads(line[6:]) async for line in r.aiter_lines()
                      if line.startswith("data: {")]
        results[name] = frames[-1]["choices"][0]["finish_reason"]

    async def main() -> None:
        short = asyncio.ensure_future(stream("short", 40))  # finishes within grace
        long = asyncio.ensure_future(stream("long", 1000))  # aborted at the grace end
        for _ in range(100):
            if server.metric("everystop:num_requests_running") == 2:
                break
            await asyncio.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            refused = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "draining"
            assert (await http.get("/health")).status_code == 503
        await asyncio.gather(short, long)

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert results == {"short": "length", "long": "abort"}
        assert server.proc.wait(timeout=15) == 0, server.log()
    finally:
        server.stop()
