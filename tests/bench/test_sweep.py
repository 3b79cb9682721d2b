"""`bench sweep`: two servers, one client, loads as fractions of a measured capacity."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from everystop.bench.client import ServeOptions
from everystop.bench.sweep import (
    _plot_lines,
    merge_sweeps,
    parse_tier_mix,
    plot_sweep,
    run_sweep,
    tokenize_prompts,
    warmup_workload,
    with_tier_mix,
)
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
                                   [0.5, 1.0], base, capacity_from="fast",
                                   encode=lambda tag: [ord(c) for c in tag])
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
    assert len(prompts) == 4 * 5
    # Every run's prompts: the same tokens behind a tag of that run's own (no run can hit
    # another's cached prompts); 5 runs (capacity, two targets at two loads), 5 tags.
    tails = {(106, 106, 100), (106, 106, 101), (106, 106, 102), (106, 106, 103)}
    assert all(tuple(p[-3:]) in tails for p in prompts)
    heads = {tuple(p[:-3]) for p in prompts}
    assert len(heads) == 5 and all(heads)
    plot = plot_sweep(data, tmp_path / "sweep.png")
    assert plot.stat().st_size > 10_000


def test_warmup_runs_first_on_every_target_and_stays_out_of_the_results(tmp_path: Path) -> None:
    reqs = [WorkloadRequest(f"r{i}", f"prompt {i}", 2, 3, None, 1) for i in range(6)]
    full = Workload("t", 0, {}, reqs)
    measured = full.head(4)
    warm = warmup_workload(full, 4, 2)
    assert [r.id for r in warm.requests] == ["r4", "r5"]  # not the measured prompts
    assert [r.id for r in warmup_workload(full, 6, 2).requests] == ["r0", "r1"]
    server = FakeServer(ttft_s=0.01, itl_s=0.002)
    saved: list[list[str]] = []  # the loads done at each save, as a cut-short sweep keeps them

    async def main() -> dict:
        await server.start()
        try:
            return await run_sweep(measured, {"a": server.base_url}, [1.0, 2.0],
                                   ServeOptions(progress=False, timeout_s=30,
                                                send_priority=True),
                                   capacity_rps=50.0, warmup=warm,
                                   on_progress=lambda r: saved.append(list(r["runs"]["a"])))
        finally:
            await server.stop()

    data = asyncio.run(asyncio.wait_for(main(), 60))
    assert data["warmup"]["by_target"]["a"]["completed"] == 2
    assert data["warmup"]["excluded_from_results"] is True
    assert data["runs"]["a"]["1"]["summary"]["completed"] == 4
    assert saved == [["1"], ["1", "2"]]
    assert len(data["runs"]["a"]["1"]["load_average_before"]) == 3
    first_two = [body["prompt"] for body in server.received[:2]]
    assert sorted(first_two) == ["[a warm-up] prompt 4", "[a warm-up] prompt 5"]  # first
    assert all(body["priority"] == 1 for body in server.received)
    assert _plot_lines(data).keys() == {"a", "a tier 1"}  # a line per tier when sent
    assert plot_sweep(data, tmp_path / "tiers.png").stat().st_size > 10_000


def test_tier_mix_assigns_exact_shares_and_pieces_merge() -> None:
    reqs = [WorkloadRequest(f"r{i}", "p", 2, 3, None, 1) for i in range(10)]
    mixed = with_tier_mix(Workload("t", 0, {}, reqs), parse_tier_mix("0.2:0:0.8"), seed=3)
    assert sorted(r.priority for r in mixed.requests) == [0, 0] + [2] * 8
    assert mixed.requests[0].id == "r0"  # order and ids kept
    with pytest.raises(ValueError):
        parse_tier_mix("1:2")

    def piece(load: str, capacity: float) -> dict:
        return {"meta": {"workload": "w", "num_requests": 10, "capacity_rps": capacity,
                         "targets": {"a": "u"}, "loads": [float(load)], "started": load},
                "runs": {"a": {load: {"offered_rps": float(load)}}}}

    merged = merge_sweeps(piece("0.5", 2.0), piece("0.25", 2.0))
    assert set(merged["runs"]["a"]) == {"0.5", "0.25"} and merged["meta"]["loads"] == [0.25, 0.5]
    assert [p["started"] for p in merged["pieces"]] == ["0.5", "0.25"]
    with pytest.raises(ValueError, match="capacity_rps"):
        merge_sweeps(piece("0.5", 2.0), piece("0.25", 3.0))
