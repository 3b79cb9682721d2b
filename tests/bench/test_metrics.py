"""The metric arithmetic: TPOT, throughput, goodput, per-tier/tenant breakdowns."""

from __future__ import annotations

import pytest

from everystop.bench.metrics import SLO, RequestResult, full_report, summarize


def _r(rid: str, ttft: float, itls: list[float], prio: int = 1, tenant: str = "a",
       prompt_len: int = 10) -> RequestResult:
    e2e = ttft + sum(itls)
    return RequestResult(rid, prompt_len, len(itls) + 1, prio, tenant, output_tokens=len(itls) + 1,
                         ttft_s=ttft, e2e_s=e2e, itl_s=list(itls))


def test_tpot_excludes_first_token_and_needs_two_tokens() -> None:
    r = _r("a", 0.5, [0.1, 0.2, 0.3])  # 4 tokens, e2e 1.1
    assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    assert _r("b", 0.5, []).tpot_s is None


def test_summary_numbers_from_known_timings() -> None:
    results = [_r("a", 0.1, [0.02] * 9, prompt_len=100),   # 10 tokens
               _r("b", 0.3, [0.04] * 4, prompt_len=50)]    # 5 tokens
    fail = RequestResult("c", 7, 5, success=False, error="HTTP 500")
    s = summarize(results + [fail], duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["output_tokens"] == 15 and s["input_tokens"] == 150
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(7.5)
    assert s["total_token_throughput"] == pytest.approx(82.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(100 + 200 * 0.99)
    assert s["tpot_ms"]["p50"] == pytest.approx(30.0)
    assert s["itl_ms"]["n"] == 13
    assert s["itl_ms"]["mean"] == pytest.approx((9 * 20 + 4 * 40) / 13)
    assert s["e2e_ms"]["p50"] == pytest.approx((280 + 460) / 2)


def test_goodput_counts_only_requests_meeting_every_slo() -> None:
    results = [_r("fast", 0.1, [0.01] * 4), _r("slow_start", 2.0, [0.01] * 4),
               _r("slow_decode", 0.1, [0.5] * 4)]
    s = summarize(results, 1.0, SLO(ttft_ms=500, tpot_ms=100))
    assert s["goodput"]["requests_per_s"] == pytest.approx(1.0)
    assert s["goodput"]["fraction"] == pytest.approx(1 / 3)
    only_ttft = summarize(results, 1.0, SLO(ttft_ms=500))
    assert only_ttft["goodput"]["requests_per_s"] == pytest.approx(2.0)
    assert "goodput" not in summarize(results, 1.0, SLO())


def test_breakdowns_by_tier_and_tenant_partition_the_requests() -> None:
    results = [_r("a", 0.1, [0.01], prio=0, tenant="x"), _r("b", 0.2, [0.01], prio=2, tenant="x"),
               _r("c", 0.9, [0.01], prio=2, tenant="y")]
    rep = full_report(results, 1.0)
    assert set(rep["by_priority"]) == {"0", "2"} and set(rep["by_tenant"]) == {"x", "y"}
    assert rep["by_priority"]["2"]["completed"] == 2
    assert rep["by_priority"]["2"]["ttft_ms"]["mean"] == pytest.approx(550)
    assert rep["by_tenant"]["y"]["ttft_ms"]["p99"] == pytest.approx(900)
    assert sum(v["output_tokens"] for v in rep["by_tenant"].values()) == \
        rep["summary"]["output_tokens"]
    assert [row["id"] for row in rep["requests"]] == ["a", "b", "c"]
