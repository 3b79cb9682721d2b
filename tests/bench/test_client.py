"""`bench serve` against a fake streaming server with known timings."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from everystop.bench.client import ServeOptions, api_root, run_serve, send_schedule
from everystop.bench.metrics import SLO
from everystop.workload import Workload, WorkloadRequest

from .fake_sse_server import FakeServer

SLACK = 2.0  # generous upper bounds: the machine is shared; lower bounds are exact


def _workload(n: int = 6, max_tokens: int = 5) -> Workload:
    reqs = [WorkloadRequest(f"r{i}", f"prompt number {i}", 3, max_tokens, None, i % 3,
                            "ta" if i % 2 else "tb") for i in range(n)]
    return Workload("t", 0, {}, reqs)


def _serve(server: FakeServer, wl: Workload, **kw: object) -> dict:
    async def main() -> dict:
        await server.start()
        try:
            opts = ServeOptions(base_url=server.base_url, progress=False, **kw)  # type: ignore[arg-type]
            return await run_serve(wl, opts)
        finally:
            await server.stop()
    return asyncio.run(asyncio.wait_for(main(), 60))


def test_per_request_timings_match_the_server_schedule() -> None:
    server = FakeServer(ttft_s=0.15, itl_s=0.03)
    rep = _serve(server, _workload(n=4, max_tokens=6))
    s = rep["summary"]
    assert s["completed"] == 4 and s["failed"] == 0 and s["output_tokens"] == 24
    for row in rep["requests"]:
        assert row["output_tokens"] == 6 and len(row["itl_s"]) == 5
        assert 0.15 <= row["ttft_s"] < 0.15 + SLACK
        # the last token cannot arrive before the server sent it
        assert row["ttft_s"] + sum(row["itl_s"]) >= 0.15 + 5 * 0.03 - 1e-3
        assert row["e2e_s"] >= row["ttft_s"] + sum(row["itl_s"]) - 1e-6
        assert row["tpot_s"] == pytest.approx((row["e2e_s"] - row["ttft_s"]) / 5)
        assert 0.03 * 0.5 < row["tpot_s"] < 0.03 + SLACK
    assert s["ttft_ms"]["p50"] >= 150 and s["itl_ms"]["n"] == 20
    assert s["output_throughput"] == pytest.approx(24 / s["duration_s"])
    assert set(rep["by_tenant"]) == {"ta", "tb"} and set(rep["by_priority"]) == {"0", "1", "2"}


def test_request_body_is_plain_openai_with_ignore_eos() -> None:
    server = FakeServer(ttft_s=0.0, itl_s=0.0)
    rep = _serve(server, _workload(n=2, max_tokens=3))
    assert rep["meta"]["model"] == "fake-model"  # discovered from /v1/models
    body = server.received[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 3
    assert body["model"] == "fake-model" and body["user"] in ("ta", "tb")
    assert "priority" not in body and body["prompt"].startswith("prompt number")
    server2 = FakeServer(ttft_s=0.0, itl_s=0.0)
    _serve(server2, _workload(n=2, max_tokens=3), endpoint="chat", send_priority=True,
           model="m")
    body = server2.received[0]
    assert body["messages"][0]["role"] == "user" and "priority" in body and body["model"] == "m"


def test_failed_requests_are_counted_not_timed() -> None:
    wl = _workload(n=3, max_tokens=4)
    wl.requests[1].prompt = "please FAIL"
    rep = _serve(FakeServer(ttft_s=0.0, itl_s=0.0), wl)
    assert rep["summary"]["completed"] == 2 and rep["summary"]["failed"] == 1
    bad = rep["requests"][1]
    assert not bad["success"] and "500" in bad["error"]
    assert rep["summary"]["ttft_ms"]["n"] == 2


def test_max_concurrency_serialises_requests() -> None:
    server = FakeServer(ttft_s=0.1, itl_s=0.0)
    rep = _serve(server, _workload(n=3, max_tokens=1), max_concurrency=1)
    sends = sorted(r["sent_s"] for r in rep["requests"])
    # one at a time: each send waits for the previous request's ~0.1 s stream
    assert sends[1] - sends[0] >= 0.1 - 1e-3 and sends[2] - sends[1] >= 0.1 - 1e-3


def test_goodput_uses_the_slo() -> None:
    server = FakeServer(ttft_s=0.2, itl_s=0.0)

    async def main() -> dict:
        await server.start()
        try:
            opts = ServeOptions(base_url=server.base_url + "/v1/", progress=False)
            return await run_serve(_workload(n=2, max_tokens=2), opts, SLO(ttft_ms=100))
        finally:
            await server.stop()
    rep = asyncio.run(asyncio.wait_for(main(), 60))
    assert rep["summary"]["completed"] == 2
    assert rep["summary"]["goodput"]["requests_per_s"] == 0.0  # every TTFT is >= 200 ms


def test_send_schedule_and_api_root() -> None:
    wl = _workload(n=5)
    assert send_schedule(wl, ServeOptions(rate=math.inf)) == [0.0] * 5
    timed = send_schedule(wl, ServeOptions(rate=10.0, seed=1))
    assert timed == send_schedule(wl, ServeOptions(rate=10.0, seed=1)) and timed[-1] > 0
    wl.requests[2].arrival_s = 1.5
    assert send_schedule(wl, ServeOptions(rate=None))[2] == 1.5
    assert api_root("http://h:1/v1/") == api_root("http://h:1") == "http://h:1"


def test_sse_lines_end_at_newline_only() -> None:
    # U+2028 and U+0085 are left unescaped in JSON (and turn up in text decoded from random
    # prompts); a line splitter that breaks there hands json.loads half an event.
    from everystop.bench.client import sse_lines

    event = 'data: {"text": "a\u2028b\x85c"}'.encode()
    stream = event + b"\r\n\r\n" + b"data: [DONE]\n"
    lines, pending = [], b""
    for i in range(0, len(stream), 5):  # chunk boundaries inside the event
        got, pending = sse_lines(pending, stream[i:i + 5])
        lines += got
    assert pending == b""
    assert lines == [event, b"", b"data: [DONE]"] and json.loads(lines[0][6:]) == {
        "text": "a\u2028b\x85c"}
