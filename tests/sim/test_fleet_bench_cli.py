"""The fleet simulator's benchmarks run as `everystop bench` subcommands and write their JSON."""

import json
from pathlib import Path

import everystop
from everystop.cli import main


def test_fleet_speed_runs_as_a_bench_subcommand(tmp_path):
    out = tmp_path / "speed.json"
    assert main(["bench", "fleet-speed", "--requests", "40", "--replicas", "2",
                 "--profile-requests", "20", "--out", str(out),
                 "--baseline-src", str(Path(everystop.__file__).parents[1])]) == 0
    r = json.loads(out.read_text())
    assert r["requests"] == 40 and r["simulated"]["num_finished"] == 40
    assert r["cpu_ms_per_request"] > 0 and r["command"].startswith("everystop")
    # the scheduler's own passes are a part of the run's CPU, not all of it
    assert 0 < r["scheduler_pass_cpu_ms_per_request"] < r["cpu_ms_per_request"]
    assert r["other_cpu_ms_per_request"] > 0
    # the baseline here is this very tree, run in a fresh process: it must simulate the same
    assert r["baseline"]["same_summary"] is True and r["baseline"]["cpu_s"] > 0
    assert abs(sum(r["profile_time_share"].values()) - 1.0) < 0.01
