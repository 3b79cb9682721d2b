"""The fleet simulator's benchmarks run as `everystop bench` subcommands and write their JSON."""

import json
from pathlib import Path

import pytest

import everystop
from everystop.cli import main


def test_fleet_speed_runs_as_a_bench_subcommand(tmp_path):
    out = tmp_path / "speed.json"
    assert main(["bench", "fleet-speed", "--requests", "40", "--replicas", "2",
                 "--profile-requests", "20", "--out", str(out), "--workers", "2",
                 "--baseline-src", str(Path(everystop.__file__).parents[1])]) == 0
    r = json.loads(out.read_text())
    assert r["requests"] == 40 and r["simulated"]["num_finished"] == 40
    assert r["cpu_ms_per_request"] > 0 and r["command"].startswith("everystop")
    # the scheduler's own passes are a part of the run's CPU, not all of it
    assert 0 < r["scheduler_pass_cpu_ms_per_request"] < r["cpu_ms_per_request"]
    assert r["other_cpu_ms_per_request"] > 0
    # timed by tenths of the arrivals: ten CPU rates, which cover the run's CPU but the
    # building of the replicas before the first arrival, and the fleet's fill-up over them
    tenths = r["cpu_ms_per_request_by_tenth"]
    assert len(tenths) == 10 and all(t > 0 for t in tenths)
    assert sum(tenths) / 10 <= r["cpu_ms_per_request"] * 1.01
    assert r["steady_cpu_ms_per_request"] > 0
    rows = r["running_rows_per_scheduler_pass_by_tenth"]
    assert len(rows) == 10 and all(n is None or n >= 0 for n in rows)
    assert rows[0] < max(n for n in rows if n is not None)  # the fleet starts empty
    assert r["extrapolated_cpu_s_for_target"] == round(
        r["steady_cpu_ms_per_request"] / 1e3 * r["target_requests"], 1)
    # 40 requests are not the 1M target: extrapolated, not measured
    assert r["measured_cpu_s_for_target"] is None and r["meets_target_measured"] is None
    assert r["max_rss_mib"] > 0
    assert r["baseline"]["steady_cpu_ms_per_request"] > 0
    # the baseline here is this very tree, run in a fresh process: it must simulate the same
    assert r["baseline"]["same_summary"] is True and r["baseline"]["cpu_s"] > 0
    assert abs(sum(r["profile_time_share"].values()) - 1.0) < 0.01
    # the same run on two worker processes simulates the same, timed by the wall clock
    par = r["parallel"]
    assert par["workers"] == 2 and par["same_summary"] is True
    assert par["wall_s"] > 0 and par["workers_cpu_s"] > 0
    assert len(par["wall_ms_per_request_by_tenth"]) == 10
    assert par["extrapolated_wall_s_for_target"] == round(
        par["steady_wall_ms_per_request"] / 1e3 * r["target_requests"], 1)


def test_a_run_of_the_target_size_is_measured_not_extrapolated(tmp_path):
    out = tmp_path / "speed.json"
    assert main(["bench", "fleet-speed", "--requests", "30", "--replicas", "2",
                 "--target-requests", "30", "--profile-requests", "10", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["measured_cpu_s_for_target"] == round(r["cpu_ms_per_request"] / 1e3 * 30, 1)
    assert r["meets_target_measured"] is (r["measured_cpu_s_for_target"] < 600)


def test_the_target_run_on_workers_alone_is_checked_against_a_one_process_run(tmp_path, capsys):
    one, par = tmp_path / "one.json", tmp_path / "par.json"
    assert main(["bench", "fleet-speed", "--requests", "30", "--replicas", "3",
                 "--target-requests", "30", "--profile-requests", "10", "--out", str(one)]) == 0
    assert main(["bench", "fleet-speed", "--requests", "30", "--replicas", "3",
                 "--target-requests", "30", "--workers", "2", "--parallel-only", str(one),
                 "--out", str(par)]) == 0
    r = json.loads(par.read_text())
    assert r["workers"] == 2 and r["same_simulated_as_one_process"] is True
    assert r["simulated"] == json.loads(one.read_text())["simulated"]
    assert r["measured_wall_s_for_target"] == r["wall_s"] > 0
    assert r["meets_target_measured"] is (r["wall_s"] < 600)
    # another size than the one-process run's is refused, not compared
    with pytest.raises(SystemExit, match="not a one-process run of this size"):
        main(["bench", "fleet-speed", "--requests", "20", "--replicas", "3", "--workers", "2",
              "--parallel-only", str(one), "--out", str(par)])


def test_fleet_speed_runs_as_a_module_with_a_baseline_on_another_interpreter(tmp_path):
    """`python -m everystop.sim.fleet_speed` (how PyPy runs it) names itself in the result, and
    --baseline-python runs the baseline on the interpreter given (here this one again)."""
    import platform
    import sys

    from everystop.sim.fleet_speed import main as speed_main

    out = tmp_path / "speed.json"
    src = str(Path(everystop.__file__).parents[1])
    assert speed_main(["--requests", "20", "--replicas", "2", "--profile-requests", "10",
                       "--out", str(out), "--baseline-src", src,
                       "--baseline-python", sys.executable]) == 0
    r = json.loads(out.read_text())
    assert r["command"].startswith(
        f"{Path(sys.executable).name} -m everystop.sim.fleet_speed --requests 20 ")
    assert r["command"].endswith(f"--baseline-python {sys.executable}")
    here = f"{sys.implementation.name} {platform.python_version()}"
    assert r["baseline"]["python"] == here and r["machine"]["python"].startswith(here)
    assert r["baseline"]["same_summary"] is True
