"""`everystop bench served` end to end on the everystop side (llama.cpp is not built here): a
fresh default-flag server per scenario, the same client as llama.cpp's run, every figure the
comparison reads present and sane."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from everystop.bench import served
from everystop.cli import main
from everystop.executor.models.loader import default_model_path
from everystop.workload import load_workload

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.model, pytest.mark.server]


def test_a_step_reads_the_weights_of_the_file() -> None:
    path = str(default_model_path())
    weights = served.step_weight_bytes(path)
    # The Q4_1 file: ~92 MiB of tensors, a little less than the file (header, vocabulary).
    assert 80 << 20 < weights < Path(path).stat().st_size


def test_everystop_side_runs_both_scenarios_with_its_defaults(tmp_path: Path) -> None:
    out = tmp_path / "served.json"
    # Both scenarios' own prompts with 16 new tokens each (not their 62-198 and 64): a figure
    # needs a few decode steps, not many (each scenario is a warm-up request, then its own).
    for name, source in (("concurrent", "perf-mixed-128"), ("single", "single-16")):
        workload = load_workload(ROOT / "benchmarks/workloads" / f"{source}.json")
        workload.requests = [replace(r, max_tokens=16) for r in workload.requests]
        workload.save(tmp_path / f"{name}.json")
    # No --llama-server: everystop's side alone.
    assert main(["bench", "served", "--gguf", str(default_model_path()),
                 "--model", "default", "--workload", str(tmp_path / "concurrent.json"),
                 "--num-requests", "3", "--single-workload", str(tmp_path / "single.json"),
                 "--single-requests", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    for scenario, n in (("concurrent", 3), ("single", 2)):
        run = r[scenario]["everystop"]
        assert run["command"] == ["everystop", "serve"]  # no flags: the defaults
        assert run["completed"] == n and run["failed"] == 0
        assert 0 < run["output_tokens"] <= 16 * n and run["peak_rss_bytes"] > 50 << 20
        assert 0 < run["start_to_health_s"] < 300
        assert "llamacpp" not in r[scenario]
    single = r["single"]["everystop"]
    assert 0 < single["bound_share"] < 1
    assert r["weight_stream_floor_ms"] == pytest.approx(
        r["weight_bytes"] / (r["read_bandwidth_gb_s"] * 1e9) * 1e3)


def test_a_moe_step_reads_the_lm_head_and_its_chosen_share_of_the_experts(
        tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "moe.gguf"
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_expert_count(4)
    writer.add_expert_used_count(1)
    for name, shape in (("token_embd.weight", (8, 4)), ("output.weight", (8, 4)),
                        ("blk.0.ffn_gate_exps.weight", (4, 2, 4))):
        writer.add_tensor(name, np.zeros(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # the LM head whole (128 B), no embedding (untied: one row), a quarter of the experts
    assert served.step_weight_bytes(str(path)) == 128 + 128 // 4
