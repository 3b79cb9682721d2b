"""docs/fleet-simulation.md is what its saved results say: the committed page is the render of
the committed JSONs (`everystop bench fleet-report --render-only`), and its tables follow the
data they are given."""

from __future__ import annotations

import json

from everystop.sim import fleet_report, fleet_report_md


def test_the_committed_page_is_the_render_of_the_committed_results() -> None:
    saved = json.loads(fleet_report.OUT_JSON.read_text())
    assert fleet_report.DOC.read_text() == fleet_report_md.render(saved), (
        "docs/fleet-simulation.md differs from its results: run "
        "`everystop bench fleet-report --render-only`")


def test_every_saved_speed_run_is_on_the_page() -> None:
    page = fleet_report.DOC.read_text()
    for label, path in fleet_report_md.SPEED_RUNS:
        assert path.exists(), path
        run = json.loads(path.read_text())
        assert f"| {label} | {run['requests']:,} x {run['replicas']} | {run['wall_s']:,.0f} |" \
            in page


def test_the_speed_verdict_and_machine_follow_the_run() -> None:
    run = {"requests": 1_000_000, "replicas": 64, "wall_s": 700.0, "target_s": 600,
           "meets_target_measured": False, "cpu_count": 2,
           "machine": {"model": "AMD EPYC", "cpu_id": "family 25 model 17",
                       "isa_flags": ["avx2", "fma"]}}
    row = fleet_report_md.speed_table([("PyPy, one process", run)])[2]
    assert "| 700 | 0.700 | not met (< 600 s) |" in row
    assert "AMD EPYC (family 25 model 17), 2 cores; avx2 fma" in row
    fast = dict(run, wall_s=400.0, meets_target_measured=True)
    assert "| 400 | 0.400 | met (< 600 s) |" in fleet_report_md.speed_table([("x", fast)])[2]
