"""The schema migrates (from nothing and from v1, keeping rows) and rows round-trip, on both
backends."""

from __future__ import annotations

import dataclasses

import pytest

from everystop.telemetry.rows import AlertRow, ConfigRow, IterationRow, SequenceRow
from everystop.telemetry.schema import LATEST_VERSION
from everystop.telemetry.store import Store, open_store

T0 = 1_750_000_000.25


def seq_row(i: int, **kw: object) -> SequenceRow:
    base = dict(seq_id=f"s{i}", request_id=f"r{i}", tenant_id="acme", priority_tier=1,
                prompt_tokens=10 + i, max_output_tokens=20, generated_tokens=20, cached_tokens=4,
                num_computed_tokens=29 + i, status="finished", finish_reason="length",
                preemption_count=0, num_preemptions_recompute=0, num_preemptions_swap=0,
                num_kv_blocks=8, arrival_time=T0 + i, admitted_at=T0 + i + 0.5,
                completed_at=T0 + i + 2.0, queue_wait_ms=500.0, ttft_ms=600.0, tpot_p50_ms=50.0,
                e2e_ms=2000.0, model_version="toy")
    base.update(kw)
    return SequenceRow(**base)  # type: ignore[arg-type]


def iteration_row(i: int) -> IterationRow:
    return IterationRow(recorded_at=T0 + i, step=i, num_decode_tokens=3, num_prefill_tokens=16,
                        batch_size=4, free_kv_blocks=100 - i, iteration_latency_ms=1.5,
                        num_running=4, num_waiting=2, num_preempted=0, context_tokens=80,
                        execute_ms=1.25, predicted_step_ms=1.5,
                        tpot_target_ms=None if i % 2 else 100.0, prefill_budget_tokens=12 + i,
                        step_cost_fixed_s=0.004, step_cost_prefill_token_s=2.5e-4,
                        step_cost_decode_row_s=1e-4, step_cost_context_token_s=3e-7)


def assert_rows_equal(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        gd, wd = dataclasses.asdict(g), dataclasses.asdict(w)
        for k in w.time_fields:  # TIMESTAMPTZ keeps microseconds
            if wd[k] is not None:
                assert gd.pop(k) == pytest.approx(wd.pop(k), abs=1e-5)
        assert gd == wd


def test_fresh_database_is_migrated_to_latest_and_migrate_is_idempotent(store_target: str) -> None:
    store = open_store(store_target)
    try:
        assert store.schema_version() == LATEST_VERSION
        assert store.migrate() == LATEST_VERSION
        assert store.count(SequenceRow) == 0
    finally:
        store.close()
    again = open_store(store_target)  # reopening an up-to-date database changes nothing
    try:
        assert again.schema_version() == LATEST_VERSION
    finally:
        again.close()


def test_v1_database_migrates_keeping_its_rows(store_target: str) -> None:
    store = open_store(store_target, migrate=False)
    try:
        assert store.migrate(target=1) == 1
        with store._transaction() as cur:  # a row as a v1 server would have written it
            cur.execute(store._sql(
                "INSERT INTO scheduler_iterations (num_decode_tokens, num_prefill_tokens, "
                "batch_size, free_kv_blocks, iteration_latency_ms) VALUES (?, ?, ?, ?, ?)"),
                (5, 7, 6, 40, 2.5))
        assert store.migrate() == LATEST_VERSION
        [row] = store.fetch(IterationRow)
        assert (row.num_decode_tokens, row.num_prefill_tokens, row.batch_size) == (5, 7, 6)
        assert row.step == 0 and row.context_tokens == 0  # v2 columns take their defaults
        assert row.predicted_step_ms == 0 and row.tpot_target_ms is None  # and v3's
        store.insert([iteration_row(1)])
        assert store.count(IterationRow) == 2
    finally:
        store.close()


def test_rows_round_trip_and_since_filters(store: Store) -> None:
    seqs = [seq_row(i) for i in range(3)] + [seq_row(3, admitted_at=None, completed_at=None,
                                                     ttft_ms=None, tpot_p50_ms=None,
                                                     status="aborted", finish_reason="abort")]
    iters = [iteration_row(i) for i in range(5)]
    alerts = [AlertRow(T0, "starvation", 2, None, 31.0, 30.0, "tier 2 starving"),
              AlertRow(T0 + 1, "kv_leak", None, "r9", 40.0, 30.0, "leak")]
    store.insert(seqs + iters + alerts)  # mixed types in one transaction
    assert_rows_equal(store.fetch(SequenceRow), seqs)
    assert_rows_equal(store.fetch(IterationRow), iters)
    assert_rows_equal(store.fetch(AlertRow), alerts)
    assert_rows_equal(store.fetch(IterationRow, since=T0 + 3), iters[3:])


def test_config_versions_get_increasing_ids(store: Store) -> None:
    rows = [ConfigRow(version=v, max_num_seqs=8 * v, max_num_batched_tokens=64, chunk_size=16,
                      gpu_memory_utilization=0.9, kv_watermark_pct=0.01,
                      max_queued_per_tenant=0, max_queued_per_tier="0,0,5", source="admin",
                      config_json="{}", updated_at=T0 + v) for v in (1, 2, 3)]
    ids = [store.insert_config(r) for r in rows]
    assert ids == sorted(ids) and len(set(ids)) == 3
    assert_rows_equal(store.fetch(ConfigRow), rows)


def test_failed_transaction_leaves_nothing_behind(store: Store) -> None:
    dup = seq_row(0)
    with pytest.raises(Exception):  # noqa: B017 - sqlite3 and psycopg raise different types
        store.insert([seq_row(1), dup, dup])  # primary key clash in the middle
    assert store.count(SequenceRow) == 0
    store.insert([seq_row(2)])  # the connection is still usable
    assert store.count(SequenceRow) == 1
