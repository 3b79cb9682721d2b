"""`everystop bench startup`: the memory breakdown from a server's start-up checkpoints, and a
quick run against a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from everystop.bench.startup import breakdown

MIB = 2**20


def test_each_stage_is_charged_what_it_grew_and_serving_splits_off_the_kv_pages() -> None:
    stages = [{"stage": "interpreter", "rss_bytes": 10 * MIB},
              {"stage": "torch import", "rss_bytes": 210 * MIB},
              {"stage": "ready", "rss_bytes": 200 * MIB}]
    after = {"rss_bytes": 230 * MIB, "peak_rss_bytes": 250 * MIB,
             "kv_pool_resident_bytes": 4 * MIB}
    table = breakdown(stages, after)
    assert list(table.values()) == [10.0, 200.0, -10.0, 4.0, 26.0, 230.0, 250.0]
    assert next(iter(table)).startswith("interpreter")
    assert sum(list(table.values())[:5]) == table["RSS after the single stream"]


@pytest.mark.model
@pytest.mark.server
def test_a_quick_run_times_the_start_and_breaks_down_the_memory(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    src = Path(__file__).resolve().parents[2] / "src"
    subprocess.run([sys.executable, "-m", "everystop", "bench", "startup", "--quick",
                    "--out", str(out), "--timeout", "100"],
                   check=True, timeout=120, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(src)})
    result = json.loads(out.read_text())
    assert list(result["starts"]) == ["second"]
    assert 0 < result["starts"]["second"]["to_health_s"] < 100
    stages = [s["stage"] for s in result["stages"]]
    assert stages[0] == "interpreter" and stages[-1] == "ready"
    assert {"server imports", "torch import", "weights", "KV pool", "tokenizer"} <= set(stages)
    assert result["single_stream"]["completion_tokens"] == 2 * 8
    table = result["memory_breakdown_mib"]
    assert table["serving: KV pages touched"] > 0
    assert table["peak RSS (VmHWM)"] >= table["RSS after the single stream"] > 100
    charged = sum(v for k, v in table.items() if not k.startswith(("RSS", "peak")))
    assert charged == pytest.approx(table["RSS after the single stream"], abs=1.0)
    assert result["machine"]["isa_flags"] is not None and result["command"]
