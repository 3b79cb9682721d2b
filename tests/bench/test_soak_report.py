"""The soak's verdict from a hand-made run (no server): per-minute rows, the checks and what
passes, so a change to how `report` is put together cannot change what it judges."""

from __future__ import annotations

import argparse
from typing import Any

from everystop.bench.soak import Soak, report

MIB = 2**20


def _state(rss_mib: float, pool_mib: float, pauses: int = 0, slow: int = 0) -> dict[str, float]:
    return {"rss": rss_mib * MIB, "kv_pool_resident": pool_mib * MIB, "gc_full_pauses": pauses,
            "gc_full_pause_s": 0.01 * pauses, "gc_full_pauses_under_100ms": pauses - slow,
            "heap_trim_calls": 3, "heap_trim_released": 5 * MIB, "heap_trim_s": 0.0021}


def make_run(valid_status: int = 200, bad_status: int = 400, end_rss_mib: float = 1010.0
             ) -> tuple[Any, ...]:
    """Two minutes of traffic: the warm-up scrape at 61 s, the drained end given apart."""
    s = Soak.__new__(Soak)  # no server: only the recorded observations
    s.t0 = 1000.0
    s.events = [
        {"at": 1010.0, "kind": "valid", "status": 200, "ttft": 0.5, "tier": 0},
        {"at": 1020.0, "kind": "valid", "status": valid_status, "ttft": 1.5, "tier": 1},
        {"at": 1030.0, "kind": "bad", "status": bad_status, "ttft": None, "tier": 1},
        {"at": 1070.0, "kind": "slow", "status": 200, "ttft": 0.7, "tier": 1},
        {"at": 1080.0, "kind": "valid", "status": 200, "ttft": 2.0, "tier": 2,
         "stream_error": "cut"},
    ]
    s.health = [(1001.0, 0.004), (1050.0, 0.03), (1075.0, 0.01)]
    s.load = [(1001.0, 1.5), (1075.0, 2.5)]
    s.server = [(1030.0, _state(900, 100, 1)), (1061.0, _state(1000, 200, 2, 1)),
                (1100.0, _state(1005, 200, 2, 1))]
    s.reloads = [(30.0, 200)]
    args = argparse.Namespace(minutes=2, load=0.8, warmup_minutes=1, server_flags=["--x"])
    state = (_state(800, 50), _state(end_rss_mib, 200, 3, 1))
    metrics = 'everystop:kv_cache_used_blocks{model_name="m"} 0\n'
    return s, 1.2, 1.5, state, metrics, args, ("up 1", "up 2")


def test_report_rows_checks_and_verdict() -> None:
    r = report(*make_run())
    first, second = r["per_minute"]
    assert (first["minute"], first["arrivals"], second["arrivals"]) == (0, 3, 2)
    assert first["health_max_ms"] == 30.0 and second["load_avg_1m_max"] == 2.5
    # TTFT counts valid requests only (the slow reader at 70 s is not in tier 1).
    assert (first["ttft_p99_s_tier0"], second["ttft_p99_s_tier1"]) == (0.5, None)
    assert second["ttft_p99_s_tier2"] == 2.0
    assert (first["gc_full_pauses"], second["gc_full_pauses"]) == (1, 1)
    assert (first["rss_net_of_kv_pool_mib"], second["rss_net_of_kv_pool_mib"]) == (800.0, 805.0)
    c = r["checks"]
    assert (c["valid_5xx"], c["bad_input_not_4xx"], c["kv_blocks_in_use_after_drain"]) == (0, 0, 0)
    # Judged from the warm-up scrape (1000 - 200 MiB net) to the end (1010 - 200): 10 / 1000.
    assert c["rss_growth_pct"] == 1.0 and c["rss_bytes_at_warmup_end"] == 1000 * MIB
    assert c["rss_growth_raw_pct"] == 26.25  # (1010 - 800) / 800
    assert c["gc_full_pauses_total"] == 3 and c["gc_full_pauses_over_100ms"] == 1
    assert c["heap_trim_calls_released_mib_seconds"] == [3, 5.0, 0.002]
    assert r["arrivals"] == {"valid": 3, "bad": 1, "slow": 1} and r["stream_errors"] == 1
    assert all(r["passed"].values()), r["passed"]


def test_report_fails_each_check_on_its_own() -> None:
    assert not report(*make_run(valid_status=503))["passed"]["no_5xx"]
    assert not report(*make_run(bad_status=200))["passed"]["bad_input_4xx"]
    # 2.0% judged growth is not under 2%; 1.996% rounds to 2.0 in the JSON and still passes.
    assert not report(*make_run(end_rss_mib=1020.0))["passed"]["rss_growth_under_2pct"]
    near = report(*make_run(end_rss_mib=1019.96))
    assert near["checks"]["rss_growth_pct"] == 2.0 and near["passed"]["rss_growth_under_2pct"]
