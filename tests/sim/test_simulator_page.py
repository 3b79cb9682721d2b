"""docs/simulator-report.md is the render of the committed results (report.json and the
calibrations): `everystop simulate report --markdown-only` regenerates it."""

from __future__ import annotations

import argparse

from everystop.sim import design_report, report_md


def test_the_committed_simulator_report_is_the_render_of_its_results() -> None:
    parser = argparse.ArgumentParser()
    design_report.add_arguments(parser)
    data = design_report.saved_report(parser.parse_args([]))
    assert design_report.PAGE.read_text() == report_md.render(data), (
        "docs/simulator-report.md differs from its results: run "
        "`everystop simulate report --markdown-only`")
