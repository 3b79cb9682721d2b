"""The latency-regression gate: arithmetic, and real runs against the fake server."""

from __future__ import annotations

import asyncio
import json

import pytest

from everystop.bench.client import ServeOptions, run_serve
from everystop.bench.gate import check_latency_regression, gate, verdict_line
from everystop.cli import main as everystop_main

from .fake_sse_server import FakeServer
from .test_client import _workload


def test_regression_arithmetic_follows_the_design() -> None:
    ok = check_latency_regression(100.0, 10.0, [100.0] * 99 + [119.0], [11.4] * 5)
    assert ok["passed"] and ok["tpot_p50"]["delta"] == pytest.approx(0.14)
    slow_tail = check_latency_regression(100.0, 10.0, [100.0] * 98 + [150.0, 150.0], [10.0])
    assert not slow_tail["passed"] and not slow_tail["ttft_p99"]["ok"]
    slow_decode = check_latency_regression(100.0, 10.0, [90.0], [11.6])
    assert not slow_decode["passed"] and slow_decode["ttft_p99"]["ok"]
    assert verdict_line(slow_decode).startswith("FAIL: ")
    assert "REGRESSED" in verdict_line(slow_decode).split(";")[1]


def _run(ttft_s: float, itl_s: float) -> dict:
    async def main() -> dict:
        server = await FakeServer(ttft_s=ttft_s, itl_s=itl_s).start()
        try:
            return await run_serve(_workload(n=6, max_tokens=4),
                                   ServeOptions(base_url=server.base_url, progress=False))
        finally:
            await server.stop()
    return asyncio.run(asyncio.wait_for(main(), 60))


def test_gate_passes_a_run_against_itself_and_fails_an_injected_delay(tmp_path) -> None:  # type: ignore[no-untyped-def]
    base = _run(0.02, 0.01)
    delayed = _run(0.5, 0.05)  # a server that got ~10x slower
    assert gate(base, base)["passed"]
    assert not gate(base, delayed)["passed"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(base))
    b.write_text(json.dumps(delayed))
    args = ["bench", "gate", "--baseline", str(a)]
    assert everystop_main(args + ["--candidate", str(a)]) == 0
    assert everystop_main(args + ["--candidate", str(b)]) == 1
    # limits loose enough to accept a 10x slowdown let it through
    assert everystop_main(args + ["--candidate", str(b), "--ttft-p99-pct", "10000",
                                  "--tpot-p50-pct", "10000"]) == 0


def test_gate_reads_one_run_out_of_a_compare_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    base = _run(0.0, 0.0)
    path = tmp_path / "compare.json"
    path.write_text(json.dumps({"meta": {}, "runs": {"online0.7/chunked": base}}))
    args = ["bench", "gate", "--baseline", str(path), "--candidate", str(path)]
    assert everystop_main(args + ["--baseline-run", "online0.7/chunked"]) == 0
    with pytest.raises(ValueError, match="pick one"):
        everystop_main(args)
