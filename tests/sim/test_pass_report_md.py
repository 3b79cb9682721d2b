"""Calibration (a)'s summary table counts the runs that met the goal, quiet ones apart."""

from everystop.sim.pass_report_md import pass_calibration_summary


def _run(name: str, others: float, met: bool, spread: float | None) -> dict:
    holdout = {"median_abs_rel_error": 0.02, "p90_abs_rel_error": 0.05 if met else 0.3}
    rep = ({"num_passes": 10, "p90_abs_rel_deviation": spread} if spread is not None
           else {"num_passes": 0, "num_groups": 0})
    return {"file": name, "other_processes_cpu": others, "repeatability": rep,
            "regimes": {"holdout": holdout, "meets_goal": met}, "base": {"holdout": holdout}}


def test_summary_counts_met_runs_and_quiet_ones_and_skips_files_without_the_regime_form():
    runs = [_run("a.json", 0.01, True, 0.02), _run("b.json", 0.6, False, 0.14),
            _run("c.json", 0.5, True, None), {"file": "old.json", "other_processes_cpu": 0.0}]
    lines = pass_calibration_summary(runs)
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["| `a.json`", "| `b.json`",
                                                              "| `c.json`"]
    assert "| 60.0% | 14.0% | 2.0%, 30.0% |" in lines[3] and "| n/a |" in lines[4]
    assert lines[-1] == ("The regime form met the goal in 2 of 3 runs; in 1 of 1 runs where "
                         "other processes used at most 5% of the cores.")
    assert pass_calibration_summary([{"file": "old.json"}]) == []
