"""`bench sweep`: two servers, one client, loads as fractions of a measured capacity."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from everystop.bench.client import ServeOptions
from everystop.bench.sweep import plot_sweep, run_sweep, tokenize_prompts
from everystop.workload import Workload, WorkloadRequest

from .fake_sse_server import FakeServer


class _Ids:
    def encode(self, text: str) -> list[int]:
        return [100 + len(w) for w in text.split()]


def test_sweep_runs_every_target_at_every_load_with_the_same_tokens(tmp_path: Path) -> None:
    reqs = [WorkloadRequest(f"r{i}", f"prompt number {i}", 3, 4, None, i % 3) for i in range(4)]
    wl = Workload("t", 0, {}, reqs)
    fast, slow = FakeServer(ttft_s=0.02, itl_s=0.005), FakeServer(ttft_s=0.12, itl_s=0.02)

    async def main() -> dict:
        await fast.start()
        await slow.start()
        try:
            base = ServeOptions(progress=False, timeout_s=30,
                                prompt_token_ids=tokenize_prompts(wl, _Ids()))
            return await run_sweep(wl, {"fast": fast.base_url, "slow": slow.base_url},
                                   [0.5, 1.0], base, capacity_from="fast")
        finally:
            await fast.stop()
            await slow.stop()

    data = asyncio.run(asyncio.wait_for(main(), 60))
    capacity = data["meta"]["capacity_rps"]
    assert capacity == pytest.approx(data["saturated"]["summary"]["request_throughput"])
    for name in ("fast", "slow"):
        assert set(data["runs"][name]) == {"0.5", "1"}
        assert data["runs"][name]["0.5"]["offered_rps"] == pytest.approx(0.5 * capacity)
        for run in data["runs"][name].values():
            assert run["summary"]["completed"] == 4 and run["summary"]["output_tokens"] == 16
    ttft = {n: data["runs"][n]["1"]["summary"]["ttft_ms"]["p50"] for n in ("fast", "slow")}
    assert ttft["slow"] >= 120 > ttft["fast"]
    prompts = [body["prompt"] for body in fast.received + slow.received]
    assert len(prompts) == 4 * 5 and all(p in ([106, 106, 101], [106, 106, 102], [106, 106, 100],
                                                [106, 106, 103]) for p in prompts)
    plot = plot_sweep(data, tmp_path / "sweep.png")
    assert plot.stat().st_size > 10_000
