"""The package ships the product: measurement and report code (bench/, the report-writing and
speed-measuring parts of sim/, plots) stays at most a quarter of src/everystop's lines.
One-off investigations answer their question in a commit and leave (git keeps them)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "everystop"
MAX_SHARE = 0.25
# Measurement and report code outside bench/: what writes the simulator's and the fleet's pages,
# what times the simulator, and the plots.
REPORT_MODULES = ["sim/report.py", "sim/report_md.py", "sim/design_report.py",
                  "sim/fleet_report.py", "sim/fleet_report_md.py", "sim/fleet_speed.py",
                  "plots.py"]


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def measurement_share(package: Path = PACKAGE) -> tuple[int, int]:
    """(measurement and report lines, all lines) of the package's Python files."""
    total = sum(_lines(p) for p in package.rglob("*.py"))
    bench = sum(_lines(p) for p in (package / "bench").rglob("*.py"))
    reports = sum(_lines(package / m) for m in REPORT_MODULES if (package / m).exists())
    return bench + reports, total


def test_every_report_module_named_exists() -> None:
    missing = [m for m in REPORT_MODULES if not (PACKAGE / m).exists()]
    assert not missing, f"renamed or deleted: update REPORT_MODULES ({missing})"


def test_measurement_and_report_code_is_at_most_a_quarter_of_the_package() -> None:
    measured, total = measurement_share()
    assert measured / total <= MAX_SHARE, (
        f"bench/ + report code is {measured} of {total} lines ({measured / total:.1%}); move "
        "investigations that answered their question out of src/everystop (tools/ or git log)")


def test_the_share_counts_bench_files(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "core.py").write_text("a = 1\n" * 30)
    (tmp_path / "bench" / "x.py").write_text("b = 2\n" * 10)
    (tmp_path / "plots.py").write_text("c = 3\n" * 10)
    assert measurement_share(tmp_path) == (20, 50)
