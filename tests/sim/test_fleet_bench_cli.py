"""The fleet simulator's benchmarks run as `everystop bench` subcommands and write their JSON."""

import json

from everystop.cli import main


def test_fleet_speed_runs_as_a_bench_subcommand(tmp_path):
    out = tmp_path / "speed.json"
    assert main(["bench", "fleet-speed", "--requests", "40", "--replicas", "2",
                 "--profile-requests", "20", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["requests"] == 40 and r["simulated"]["num_finished"] == 40
    assert r["cpu_ms_per_request"] > 0 and r["command"].startswith("everystop")
    assert abs(sum(r["profile_time_share"].values()) - 1.0) < 0.01
