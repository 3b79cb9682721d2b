"""Guardrails fire on what aggregate numbers hide: a prefill spike, a starving tier, blocks held
without progress - as log lines, stored alerts and metrics."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from everystop.telemetry.alerts import GuardrailConfig
from everystop.telemetry.rows import AlertRow
from everystop.telemetry.service import Telemetry
from everystop.telemetry.store import Store
from tests.core.helpers import FakeClock

from .helpers import make_engine, params, run


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    samples = {}
    for family in registry.collect():
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def test_prefill_ceiling_counts_every_breach_and_reports_once(caplog) -> None:
    clock = FakeClock()
    eng = make_engine(clock, chunk_size=32, max_num_batched_tokens=64)
    tel = Telemetry(None, eng, guardrail_config=GuardrailConfig(prefill_ceiling=20))
    registry = CollectorRegistry()
    tel.register_metrics(registry)
    eng.add_request("x" * 90, params(2))  # chunks of 32, 32, 26: three breaches...
    eng.add_request("y" * 10, params(2))  # ...the first with all of y's 10 beside it
    run(eng, clock, dt=0.01)
    with caplog.at_level(logging.WARNING, logger="everystop.telemetry"):
        alerts = tel.check_now()
    assert [a.kind for a in alerts] == ["prefill_ceiling"]  # reported at most once per 10 s
    assert "over the ceiling of 20" in caplog.text
    metrics = scrape(registry)
    assert metrics["everystop:guardrail_alerts_total{kind=prefill_ceiling,tier=}"] == 3
    assert metrics["everystop:max_prefill_tokens_per_iteration{}"] == 42
    tel.close()


def test_starving_tier_alerts_once_per_episode_and_recovers(store: Store, caplog) -> None:
    clock = FakeClock()
    eng = make_engine(clock, max_num_seqs=1, aging_interval_s=1000.0)
    config = GuardrailConfig(tier_queue_sla_s=(1.0, 5.0, 30.0), sla_window_s=60.0)
    tel = Telemetry(store, eng, guardrail_config=config)
    registry = CollectorRegistry()
    tel.register_metrics(registry)
    eng.add_request("premium hog", params(500), priority=0)
    best_effort = eng.add_request("patient", params(2), priority=2, tenant="small")
    eng.add_request("standard", params(2), priority=1)

    def advance(seconds: int) -> None:  # the hog keeps decoding: busy, not stuck
        for _ in range(seconds):
            eng.step()
            clock.now += 1.0

    advance(3)
    assert tel.check_now() == []  # tier 1 waited 3 s (SLA 5), tier 2 3 s (SLA 30)
    advance(40)
    with caplog.at_level(logging.WARNING, logger="everystop.telemetry"):
        alerts = tel.check_now()
    assert sorted((a.kind, a.tier) for a in alerts) == [("starvation", 1), ("starvation", 2)]
    assert "tier 2 p99 queue wait 43.00s exceeds its SLA of 30.00s" in caplog.text
    advance(5)
    assert tel.check_now() == []  # still starving: same episode, no new alert
    metrics = scrape(registry)
    assert metrics["everystop:guardrail_alerts_total{kind=starvation,tier=2}"] == 1
    assert metrics["everystop:queue_wait_p99_seconds{tier=2}"] == 48.0
    assert metrics["everystop:queue_wait_p99_seconds{tier=0}"] == 0.0
    eng.abort_request(next(iter(r for r in eng.scheduler.running)).request_id)  # seat freed
    run(eng, clock, dt=0.01)
    clock.now += 61.0  # the slow admissions leave the window
    assert tel.check_now() == []
    assert scrape(registry)["everystop:queue_wait_p99_seconds{tier=2}"] == 0.0
    tel.writer.flush()
    stored = store.fetch(AlertRow)
    assert sorted((a.kind, a.tier) for a in stored) == [("starvation", 1), ("starvation", 2)]
    assert best_effort.admitted_time is not None
    tel.close()


def test_blocks_held_without_progress_are_a_suspected_leak(store: Store) -> None:
    clock = FakeClock()
    eng = make_engine(clock)
    tel = Telemetry(store, eng, guardrail_config=GuardrailConfig(leak_after_s=30.0))
    registry = CollectorRegistry()
    tel.register_metrics(registry)
    stuck = eng.add_request("a stream whose engine stopped", params(50))
    eng.step()  # admitted, holds blocks
    held = len(eng.kv.req_blocks[stuck.request_id])
    # An id the scheduler no longer knows but whose blocks were never returned: a real leak.
    eng.kv.req_blocks["ghost"] = []  # an empty entry is not a leak
    assert tel.check_now() == []
    clock.now += 20.0
    assert tel.check_now() == []  # not yet N seconds
    clock.now += 15.0
    alerts = tel.check_now()
    assert [(a.kind, a.request_id) for a in alerts] == [("kv_leak", stuck.request_id)]
    assert f"{held} KV blocks held by {stuck.request_id} (running)" in alerts[0].message
    assert scrape(registry)["everystop:suspected_leaked_kv_blocks{}"] == held
    clock.now += 10.0
    assert tel.check_now() == []  # alerted once per sequence
    eng.step()  # progress: no longer suspected
    clock.now += 1.0
    tel.check_now()
    assert scrape(registry)["everystop:suspected_leaked_kv_blocks{}"] == 0
    del eng.kv.req_blocks["ghost"]
    run(eng, clock)
    tel.writer.flush()
    [row] = store.fetch(AlertRow)
    assert (row.kind, row.request_id, row.threshold) == ("kv_leak", stuck.request_id, 30.0)
    tel.close()
