"""Print the counts that keep the repository a product rather than a diary: history words in
docs and code, docs/ text size, committed result files, and the measurement code's share of the
package. `python tools/product_counts.py` prints them as JSON; tests/test_product_counts.py holds
each to its limit."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "everystop"
LIMITS = {"session_numbers": 0, "docs_text_bytes": 100_000, "result_files": 30,
          "measurement_share": 0.25}
# Measurement and report code outside bench/: what writes the simulator's and the fleet's pages,
# what times the simulator, and the plots.
REPORT_MODULES = ["sim/report.py", "sim/report_md.py", "sim/design_report.py",
                  "sim/fleet_report.py", "sim/fleet_report_md.py", "sim/fleet_speed.py",
                  "plots.py"]
IMAGES = {".png", ".svg", ".jpg", ".jpeg", ".gif"}
SESSION_NUMBER = re.compile(r"\bsession[ _-]?\d+", re.IGNORECASE)
TEXT = {".py", ".md", ".txt", ".json", ".toml", ".cfg", ".sh", ".yaml", ".yml"}


def session_numbers(root: Path = ROOT) -> list[str]:
    """Places where "session" is followed by a number in src/, docs/, tests/ and the README."""
    files = [root / "README.md"] + [p for d in ("src", "docs", "tests")
                                    for p in sorted((root / d).rglob("*"))
                                    if p.is_file() and p.suffix in TEXT]
    hits = []
    for path in files:
        if path.exists():
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if SESSION_NUMBER.search(line):
                    hits.append(f"{path.relative_to(root)}:{n}")
    return hits


def docs_text_bytes(root: Path = ROOT) -> int:
    return sum(p.stat().st_size for p in (root / "docs").rglob("*")
               if p.is_file() and p.suffix.lower() not in IMAGES)


def result_files(root: Path = ROOT) -> int:
    return sum(1 for p in (root / "benchmarks" / "results").rglob("*") if p.is_file())


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def measurement_share(package: Path = PACKAGE) -> tuple[int, int]:
    """(measurement and report lines, all lines) of the package's Python files."""
    total = sum(_lines(p) for p in package.rglob("*.py"))
    bench = sum(_lines(p) for p in (package / "bench").rglob("*.py"))
    reports = sum(_lines(package / m) for m in REPORT_MODULES if (package / m).exists())
    return bench + reports, total


def counts() -> dict:
    measured, total = measurement_share()
    return {"session_numbers": len(session_numbers()), "docs_text_bytes": docs_text_bytes(),
            "result_files": result_files(), "measurement_share": round(measured / total, 4)}


if __name__ == "__main__":
    print(json.dumps({"counts": counts(), "limits": LIMITS}, indent=1))
