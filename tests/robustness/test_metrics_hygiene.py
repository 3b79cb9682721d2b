"""Tenant ids are client-controlled: they must not grow /metrics or the label set."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from everystop.server.tenants import MAX_TENANT_CHARS, clean_tenant
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.server


def test_clean_tenant_is_short_printable_distinct_and_idempotent() -> None:
    assert clean_tenant("acme-prod") == "acme-prod"
    long_a, long_b = "a" * 60_000, "a" * 59_999 + "b"
    for raw in (long_a, long_b, 'x"}\n# HELP evil', "\u00e9t\u00e9", "", "\ud800"):
        cleaned = clean_tenant(raw)
        assert 0 < len(cleaned) <= MAX_TENANT_CHARS
        assert cleaned.isascii() and cleaned.isprintable() and '"' not in cleaned
        assert clean_tenant(cleaned) == cleaned
    assert clean_tenant(long_a) != clean_tenant(long_b)


def test_huge_and_many_tenants_keep_metrics_small(toy_server: ServerProcess) -> None:
    before = len(httpx.get(toy_server.url + "/metrics", timeout=10).content)
    body = {"model": "toy", "prompt": "hi", "max_tokens": 2}
    for i in range(30):  # more tenants than the label set keeps (20)
        tenant = f"{i:02d}" + "z" * 60_000  # as `user`: uvicorn caps header sizes itself
        r = httpx.post(toy_server.url + "/v1/completions", json={**body, "user": tenant},
                       timeout=30)
        assert r.status_code == 200, r.text
    text = httpx.get(toy_server.url + "/metrics", timeout=10).text
    assert max(len(line) for line in text.splitlines()) < 400
    assert 'tenant="other"' in text
    # Was ~9 MB per such tenant. Now at most 21 label values (20 + "other") of <= 64 chars, each
    # with its per-tenant latency histograms (~35 KB per tenant since the operator's series).
    assert len(text.encode()) < before + 1_000_000


def test_served_process_froze_its_start_up_heap(toy_server: ServerProcess) -> None:
    """Full GC pauses stopped /health for ~170 ms: the server freezes what start-up left."""
    text = httpx.get(toy_server.url + "/metrics", timeout=10).text
    frozen = [line for line in text.splitlines()
              if line.startswith("everystop:gc_frozen_objects")]
    assert frozen and float(frozen[0].rsplit(" ", 1)[1]) > 10_000, frozen
    assert 'everystop:gc_pause_seconds_count{generation="2"' in text


def test_the_live_window_keeps_only_its_window() -> None:
    """Unviewed, the dashboard's window grew to 50,000 samples per kind (one gap per token);
    it now drops what is older than its window."""
    from everystop.server.live_window import LiveWindow

    now = [0.0]
    window = LiveWindow(window_s=60.0, clock=lambda: now[0])
    for _ in range(6000):  # 10 minutes at 10 samples a second of every kind
        now[0] += 0.1
        window.on_itl("t", 1, 0.05, 1)
        window.on_finished("t", 1, None, None, 4)
        window.on_rejected("tier_queue", 2)
        window.on_iteration(SimpleNamespace(num_prefill_tokens=3, num_decode_tokens=4))  # type: ignore[arg-type]
    for samples in (window._gaps, window._finished, window._rejected, window._steps):
        assert 600 <= len(samples) <= 601
    summary = window.summary()
    assert summary["window_s"] == 60.0
