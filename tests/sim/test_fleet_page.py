"""docs/fleet-simulation.md is what its saved results say: the committed page is the render of
the committed JSONs (`everystop bench fleet-report --render-only`), and the speed target's
headline follows the measured run, not the text around it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from everystop.sim import fleet_report, fleet_report_md


def test_the_committed_page_is_the_render_of_the_committed_results() -> None:
    saved = json.loads(fleet_report.OUT_JSON.read_text())
    assert fleet_report.DOC.read_text() == fleet_report_md.render(saved), (
        "docs/fleet-simulation.md differs from its results: run "
        "`everystop bench fleet-report --render-only`")


def test_the_target_headline_follows_the_measured_run(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    run = json.loads(fleet_report_md.MILLION_PYPY_JSON.read_text())
    assert run["requests"] == run["target_requests"] == 1_000_000 and run["replicas"] == 64
    assert run["meets_target_measured"] == (run["wall_s"] < run["target_s"])
    headline = fleet_report_md._target_headline()[0]
    assert f"**{run['wall_s']:,.0f} s wall**" in headline
    assert ("**met**" in headline) == run["meets_target_measured"]

    slow = dict(run, wall_s=700.0, cpu_s=699.0, meets_target_measured=False)
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(slow))
    monkeypatch.setattr(fleet_report_md, "MILLION_PYPY_JSON", path)
    headline = fleet_report_md._target_headline()[0]
    assert "**not met**" in headline and "**700 s wall**" in headline
    # the machine named as the run records it: family and model, flags, interpreter
    assert f"on {fleet_report_md._machine(slow)} " in headline
    assert "family 25 model 17" in fleet_report_md._machine(
        {"cpu_count": 2, "machine": {"model": "AMD EPYC", "cpu_id": "family 25 model 17",
                                     "isa_flags": ["avx2"], "python": "pypy 3.11.11"}})
