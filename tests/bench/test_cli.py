"""The `everystop bench` commands end to end: workload file -> serve against a fake server."""

from __future__ import annotations

import asyncio
import json
import threading

from everystop.cli import main as everystop_main

from .fake_sse_server import FakeServer


def test_workload_then_serve_writes_a_result_json(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    wl = tmp_path / "w.json"
    assert everystop_main(["bench", "workload", "--out", str(wl), "--num-requests", "5",
                           "--prompt-len", "fixed:12", "--output-len", "uniform:2:4",
                           "--tokenizer", "whitespace", "--prefix-fraction", "0.5",
                           "--prefix-len", "4"]) == 0
    data = json.loads(wl.read_text())
    assert len(data["requests"]) == 5 and data["spec"]["tokenizer"] == "whitespace-estimate"

    loop = asyncio.new_event_loop()
    server = FakeServer(ttft_s=0.01, itl_s=0.0)
    loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        out = tmp_path / "r.json"
        code = everystop_main(["bench", "serve", "--base-url", server.base_url, "--workload",
                               str(wl), "--rate", "50", "--max-concurrency", "2",
                               "--no-progress", "--slo-ttft-ms", "5000", "--result-json",
                               str(out)])
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert code == 0
    rep = json.loads(out.read_text())
    assert {"command", "git_commit", "machine", "roofline"} <= set(rep)  # write_result's
    assert rep["summary"]["completed"] == 5
    assert rep["summary"]["goodput"]["fraction"] == 1.0
    assert rep["meta"]["rate"] == 50.0 and rep["meta"]["max_concurrency"] == 2
    printed = capsys.readouterr().out
    assert "Output token throughput (tok/s)" in printed and "tenant" in printed
