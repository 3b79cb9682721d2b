"""`everystop report`: per-tenant and per-tier percentiles, preemption rates and alerts, as a
table or JSON, from either backend."""

from __future__ import annotations

import json

import pytest

from everystop.cli import main as cli_main
from everystop.telemetry.report import build_report
from everystop.telemetry.rows import AlertRow
from everystop.telemetry.store import Store

from .test_store import T0, iteration_row, seq_row


def populate(store: Store) -> None:
    rows = []
    # tenant "acme", tier 0: queue waits 10..100 ms; one in four preempted once.
    for i in range(10):
        rows.append(seq_row(i, tenant_id="acme", priority_tier=0, queue_wait_ms=10.0 * (i + 1),
                            ttft_ms=20.0 * (i + 1), tpot_p50_ms=5.0,
                            preemption_count=1 if i % 4 == 0 else 0))
    # tenant "beta", tier 2: starved - waits of seconds, preempted often; one abort.
    for i in range(4):
        rows.append(seq_row(100 + i, tenant_id="beta", priority_tier=2,
                            queue_wait_ms=1000.0 * (i + 1), ttft_ms=1000.0 * (i + 1) + 50,
                            tpot_p50_ms=40.0, preemption_count=3))
    rows.append(seq_row(200, tenant_id="beta", priority_tier=2, status="aborted",
                        finish_reason="abort", admitted_at=None, queue_wait_ms=None,
                        ttft_ms=None, tpot_p50_ms=None, preemption_count=0))
    rows += [iteration_row(i) for i in range(4)]
    rows += [AlertRow(T0 + 5, "starvation", 2, None, 42.0, 30.0, "tier 2 p99 queue wait 42s"),
             AlertRow(T0 + 6, "kv_leak", None, "r7", 35.0, 30.0, "blocks held by r7")]
    store.insert(rows)


def test_percentiles_and_rates_per_tenant_and_tier(store: Store) -> None:
    populate(store)
    report = build_report(store)
    acme, beta = report["tenants"]
    assert (acme["tenant"], acme["requests"], acme["aborted"]) == ("acme", 10, 0)
    assert acme["queue_wait_p50_ms"] == pytest.approx(55.0)
    assert acme["queue_wait_p99_ms"] == pytest.approx(99.1)
    assert acme["ttft_p50_ms"] == pytest.approx(110.0)
    assert acme["tpot_p99_ms"] == pytest.approx(5.0)
    assert acme["preemptions_per_request"] == pytest.approx(0.3)
    assert acme["preempted_fraction"] == pytest.approx(0.3)
    assert (beta["requests"], beta["aborted"]) == (5, 1)
    assert beta["queue_wait_p50_ms"] == pytest.approx(2500.0)  # the abort has no queue wait
    assert beta["preemptions_per_request"] == pytest.approx(12 / 5)
    assert [t["tier"] for t in report["tiers"]] == [0, 2]
    assert report["tiers"][1]["queue_wait_p99_ms"] == pytest.approx(3970.0)
    assert report["overall"]["requests"] == 15
    assert report["iterations"]["count"] == 4
    assert {(a["kind"], a["tier"], a["count"]) for a in report["alerts"]["counts"]} == {
        ("starvation", 2, 1), ("kv_leak", None, 1)}
    assert report["alerts"]["recent"][-1]["message"] == "blocks held by r7"
    # since: only what happened from then on
    assert build_report(store, since=T0 + 100)["tenants"][0]["requests"] == 5
    assert build_report(store, since=T0 + 1000)["tenants"] == []


def test_cli_prints_json_and_tables(store_target: str, store: Store, capsys) -> None:
    populate(store)
    assert cli_main(["report", "--db", store_target, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [t["tenant"] for t in data["tenants"]] == ["acme", "beta"]
    assert cli_main(["report", "--db", store_target]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "per tenant" in lines and any(line.startswith("acme ") for line in lines)
    header = next(line for line in lines if line.startswith("tenant"))
    assert "queue p99" in header and "ttft p50" in header and "preempt/req" in header
    assert "alerts: " in text and "starvation tier 2 x1" in text and "blocks held by r7" in text


def test_cli_refuses_a_missing_database(tmp_path, capsys) -> None:
    assert cli_main(["report", "--db", str(tmp_path / "nope.db")]) == 2
    assert "no telemetry database" in capsys.readouterr().err
    assert not (tmp_path / "nope.db").exists()


def test_empty_store_reports_nothing_without_failing(store: Store) -> None:
    report = build_report(store)
    assert report["tenants"] == [] and report["overall"]["requests"] == 0
    assert report["overall"]["queue_wait_p99_ms"] is None
    assert report["iterations"]["latency_p99_ms"] is None
