"""The one plotting module draws the simulator's run plots and a compare result's plots."""

from __future__ import annotations

import json
from pathlib import Path

from everystop.sim.node import build_node
from everystop.sim.report import write_run
from everystop.sim.simulator import simulate
from everystop.workload import synthetic


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000


def test_a_simulated_run_writes_its_json_and_both_plots(tmp_path: Path) -> None:
    node = build_node("llama-3-8b", "a100-80gb", 1, "chunked")
    result = simulate(synthetic("n=40,prompt=uniform:64:256,output=uniform:4:40,rate=50"),
                      node.setup, node.cost.latency)
    paths = write_run(tmp_path, {"num_finished": len(result.requests)}, result,
                      {"max_num_seqs": 32})
    assert [p.name for p in paths] == ["summary.json", "iterations.json", "occupancy.png",
                                       "latency_cdf.png"]
    assert json.loads(paths[0].read_text())["summary"]["num_finished"] == 40
    assert all(_is_png(p) for p in paths[2:])
