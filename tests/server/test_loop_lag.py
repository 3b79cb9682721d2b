"""The event-loop lag monitor: a blocked loop is measured, exported as a histogram, and raises
the guardrails' loop_lag alert."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, generate_latest
from starlette.testclient import TestClient

from everystop.engine.async_engine import AsyncEngine
from everystop.server.app import build_app
from everystop.server.loop_lag import LoopLagMonitor
from everystop.server.metrics import ServerMetrics
from everystop.telemetry.alerts import GuardrailConfig, Guardrails, register_alert_metrics
from tests.engine.toy_engine import make_toy_engine


def test_a_blocked_loop_is_measured_as_lag() -> None:
    samples: list[float] = []

    async def main() -> LoopLagMonitor:
        monitor = LoopLagMonitor([samples.append], interval_s=0.02)
        monitor.start()
        await asyncio.sleep(0.1)
        time.sleep(0.3)  # work on the loop: nothing else runs meanwhile
        await asyncio.sleep(0.1)
        await monitor.stop()
        return monitor

    monitor = asyncio.run(main())
    assert len(samples) >= 3
    assert monitor.max_lag_s >= 0.25 and max(samples) == monitor.max_lag_s
    assert min(samples) < 0.25  # the samples before and after the block are not lagged


def test_each_sample_is_observed_by_the_histogram_then_the_listeners() -> None:
    metrics = ServerMetrics()
    heard: list[float] = []
    metrics.loop_lag_listeners.append(heard.append)
    metrics.observe_loop_lag(0.7)
    metrics.observe_loop_lag(0.001)
    text = metrics.render().decode()
    assert 'everystop:event_loop_lag_seconds_count{model_name="unknown"} 2.0' in text
    assert 'everystop:event_loop_lag_seconds_bucket{le="0.5",model_name="unknown"} 1.0' in text
    assert heard == [0.7, 0.001]


def test_a_long_lag_raises_a_loop_lag_alert_reported_at_most_every_report_interval() -> None:
    g = Guardrails(GuardrailConfig(loop_lag_alert_s=0.5, report_every_s=10.0))
    g.on_loop_lag(0.2, now=0.0)
    assert not g.drain()
    g.on_loop_lag(1.5, now=1.0)
    g.on_loop_lag(0.9, now=2.0)  # counted, not reported again within 10 s
    alerts = g.drain()
    assert [(a.kind, a.value, a.threshold) for a in alerts] == [("loop_lag", 1.5, 0.5)]
    assert "1.50s" in alerts[0].message
    g.on_loop_lag(0.6, now=12.0)
    assert [a.value for a in g.drain()] == [0.6]
    registry = CollectorRegistry()
    register_alert_metrics(registry, g)
    text = generate_latest(registry).decode()
    assert 'everystop:guardrail_alerts_total{kind="loop_lag",tier=""} 3.0' in text


def test_the_app_samples_its_loop_while_it_runs() -> None:
    front = AsyncEngine(make_toy_engine())
    try:
        with TestClient(build_app(front, "toy")) as client:
            deadline = time.monotonic() + 10
            count = 0.0
            while count < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
                for line in client.get("/metrics").text.splitlines():
                    if line.startswith("everystop:event_loop_lag_seconds_count"):
                        count = float(line.rsplit(" ", 1)[1])
            assert count >= 2
    finally:
        front.shutdown()
