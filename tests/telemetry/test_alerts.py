"""Guardrails fire on what aggregate numbers hide: a prefill spike, a starving tier, blocks held
without progress - as log lines, stored alerts and metrics."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from everystop.config import SchedulerConfig
from everystop.core.outputs import IterationRecord
from everystop.engine.async_engine import AsyncEngine
from everystop.server.admin import install_admin_routes
from everystop.telemetry.alerts import (
    MIN_PREFILL_ROOM,
    GuardrailConfig,
    Guardrails,
    clamp_change,
)
from everystop.telemetry.rows import AlertRow, ConfigRow
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
    # max_num_seqs 4: a cap of 20 still leaves a full decode batch and a KV block of prefill
    eng = make_engine(clock, chunk_size=32, max_num_batched_tokens=64, max_num_seqs=4)
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
    tel = Telemetry(store, eng, guardrail_config=GuardrailConfig(leak_after_s=30.0,
                                                                 leak_after_steps=64))
    registry = CollectorRegistry()
    tel.register_metrics(registry)
    stuck = eng.add_request("a sequence the scheduler lost track of", params(50))
    eng.step()  # admitted, holds blocks
    held = len(eng.kv.req_blocks[stuck.request_id])
    # An id the scheduler no longer knows but whose blocks were never returned: a real leak.
    eng.kv.req_blocks["ghost"] = []  # an empty entry is not a leak
    assert tel.check_now() == []
    clock.now += 60.0
    assert tel.check_now() == []  # one slow step in flight (no iteration passed): no alarm
    # A bug drops it from the running batch while it keeps its blocks; others keep running.
    eng.scheduler.running.remove(stuck)
    other = eng.add_request("traffic", params(200))
    for _ in range(63):
        eng.step()
        clock.now += 0.01
    assert tel.check_now() == []  # not yet N iterations
    eng.step()
    alerts = tel.check_now()
    assert [(a.kind, a.request_id) for a in alerts] == [("kv_leak", stuck.request_id)]
    assert (f"{held} KV blocks held by {stuck.request_id} (running) with no progress for 64 "
            "iterations") in alerts[0].message
    assert scrape(registry)["everystop:suspected_leaked_kv_blocks{}"] == held
    eng.step()
    assert tel.check_now() == []  # alerted once per sequence
    eng.scheduler.running.append(stuck)  # found again: it progresses, no longer suspected
    eng.step()
    tel.check_now()
    assert scrape(registry)["everystop:suspected_leaked_kv_blocks{}"] == 0
    del eng.kv.req_blocks["ghost"]
    run(eng, clock)
    assert other.request_id not in eng.scheduler.requests
    tel.writer.flush()
    [row] = store.fetch(AlertRow)
    assert (row.kind, row.request_id, row.threshold) == ("kv_leak", stuck.request_id, 30.0)
    tel.close()


def _record(step: int, execute_s: float, target_s: float | None, prefill: int,
            decode: int = 4, predicted_s: float = 0.05,
            step_cost: dict[str, float] | None = None) -> IterationRecord:
    return IterationRecord(step=step, time=float(step), num_seqs=decode + 1,
                           num_decode_tokens=decode, num_prefill_tokens=prefill,
                           context_tokens=100, num_free_blocks=10, num_running=decode + 1,
                           num_waiting=0, num_preempted=0, latency_s=execute_s,
                           execute_s=execute_s, predicted_s=predicted_s, tpot_target_s=target_s,
                           step_cost=step_cost or {})


def test_an_overrun_names_a_target_below_the_decode_step() -> None:
    """50 ms against decodes fitted at 20 ms + 8 ms a row: 4 rows alone take 52 ms."""
    cost = {"fixed": 0.020, "prefill_token": 0.001, "decode_row": 0.008, "context_token": 1e-5}
    g = Guardrails(GuardrailConfig(overrun_steps=2))
    for i in range(2):
        g.on_iteration(_record(i, 0.08, 0.05, 0, decode=4, step_cost=cost), 2048)
    (alert,) = g.drain()
    assert "4 decodes alone are predicted at 53 ms" in alert.message  # + 100 context tokens
    for i in range(2, 4):  # 2 rows: 36 ms, within the target: the prefill overran it
        g.on_iteration(_record(i, 0.08, 0.05, 30, decode=2, step_cost=cost), 2048)
    (alert,) = g.drain()
    assert "alone" not in alert.message


def test_a_run_of_overruns_alerts_and_proposes_a_scaled_cap() -> None:
    g = Guardrails(GuardrailConfig(overrun_steps=4, overrun_tolerance=0.25,
                                   clamp_after_steps=4))
    for i in range(3):  # three overruns, then one step within 25 %: the run resets
        g.on_iteration(_record(i, 0.2, 0.1, 60), 2048)
    g.on_iteration(_record(3, 0.12, 0.1, 60), 2048)
    assert g.drain() == [] and g.drain_clamps() == []
    for i in range(4, 8):
        g.on_iteration(_record(i, 0.2, 0.1, 60), 2048)
    (alert,) = g.drain()
    assert alert.kind == "tpot_overrun" and alert.threshold == 0.1 and alert.value == 0.2
    # 64 tokens a step took 0.2 s against 0.1 s: propose 32
    assert [cap for cap, _ in g.drain_clamps()] == [32]
    for i in range(8, 12):  # decode-only overruns: a smaller budget cannot help, no clamp
        g.on_iteration(_record(i, 0.2, 0.1, 0), 2048)
    assert [a.kind for a in g.drain()] == ["tpot_overrun"] and g.drain_clamps() == []
    for i in range(12, 16):  # prefill the budget knew was over target (the anti-starvation
        g.on_iteration(_record(i, 0.2, 0.1, 60, predicted_s=0.15), 2048)  # floor): no clamp
    assert [a.kind for a in g.drain()] == ["tpot_overrun"] and g.drain_clamps() == []
    for i in range(16, 30):  # no target: nothing to overrun
        g.on_iteration(_record(i, 5.0, None, 60), 2048)
    assert g.drain() == []


def test_a_burst_shorter_than_the_cost_models_memory_alerts_but_does_not_clamp() -> None:
    """Overruns of steps the budget predicted within target: alerts every 8, a clamp only once
    the run outlasts clamp_after_steps (the model had time to catch up and did not)."""
    g = Guardrails(GuardrailConfig(overrun_steps=8, clamp_after_steps=50))
    step = 0

    def overrun(n: int) -> None:
        nonlocal step
        for _ in range(n):
            g.on_iteration(_record(step, 0.35, 0.2, 60, predicted_s=0.198), 2048)
            step += 1

    overrun(48)
    assert len(g.drain()) == 6 and g.drain_clamps() == []
    g.on_iteration(_record(step, 0.1, 0.2, 60), 2048)  # one step within: the streak restarts
    step += 1
    overrun(48)
    assert len(g.drain()) == 6 and g.drain_clamps() == []
    overrun(8)  # 56 in a row
    assert len(g.drain()) == 1 and [cap for cap, _ in g.drain_clamps()] == [36]  # 64*.2/.35


def test_clamp_change_never_raises_the_cap_or_starves_prefill() -> None:
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)
    assert clamp_change(cfg, 100) == {"max_num_batched_tokens": 100}
    # a full decode batch plus a KV block of prefill always fit
    assert clamp_change(cfg, 3) == {"max_num_batched_tokens": 16 + MIN_PREFILL_ROOM}
    assert clamp_change(cfg, 300) is None
    assert clamp_change(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24), 6) is None


def test_auto_clamp_is_applied_logged_and_recorded_in_the_config_history(store: Store,
                                                                         caplog) -> None:
    eng = make_engine(max_num_seqs=8, max_num_batched_tokens=256)
    front = AsyncEngine(eng, watchdog_interval_s=60.0)
    tel = Telemetry(None, front,
                    guardrail_config=GuardrailConfig(overrun_steps=3, clamp_after_steps=3,
                                                     check_interval_s=60))
    admin = install_admin_routes(FastAPI(), front, store=store, telemetry=tel)
    try:
        for i in range(3):
            tel.guardrails.on_iteration(_record(i, 0.3, 0.1, 116), 256)
        with caplog.at_level(logging.WARNING, logger="everystop.telemetry"):
            alerts = tel.check_now()
    finally:
        tel.close()
        front.shutdown()
    assert [a.kind for a in alerts] == ["tpot_overrun"]
    assert eng.scheduler.config.max_num_batched_tokens == 40  # 120 tokens * 0.1 / 0.3
    assert "auto-clamp" in caplog.text
    rows = store.fetch(ConfigRow)
    assert [(r.version, r.source, r.max_num_batched_tokens) for r in rows] == [
        (1, "startup", 256), (2, "guardrail", 40)]
    assert admin.version == 2


def test_prefill_ceiling_breach_clamps_the_budget_without_an_admin_api() -> None:
    clock = FakeClock()
    # max_num_seqs 4: a cap of 20 still leaves a full decode batch and a KV block of prefill
    eng = make_engine(clock, chunk_size=32, max_num_batched_tokens=64, max_num_seqs=4)
    tel = Telemetry(None, eng, guardrail_config=GuardrailConfig(prefill_ceiling=20))
    eng.add_request("x" * 90, params(2))
    run(eng, clock, dt=0.01)
    tel.check_now()
    assert eng.scheduler.config.max_num_batched_tokens == 20
    eng.add_request("z" * 90, params(2))
    seen = []
    eng.iteration_listeners.append(lambda rec, _: seen.append(rec.num_prefill_tokens))
    run(eng, clock, dt=0.01)
    assert seen and max(seen) <= 20
    tel.close()
