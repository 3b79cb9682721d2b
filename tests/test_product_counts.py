"""The repository ships a product, not its diary: each count `tools/product_counts.py` prints
stays within its limit (history words in docs and code, docs/ size, committed result files,
measurement code's share of the package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("product_counts",
                                                  ROOT / "tools" / "product_counts.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


counts_tool = _tool()


def test_no_session_numbers_in_docs_code_or_tests() -> None:
    hits = counts_tool.session_numbers()
    assert not hits, f"history belongs in git log, not here: {hits[:10]}"


def test_docs_text_stays_under_its_budget() -> None:
    size = counts_tool.docs_text_bytes()
    assert size < counts_tool.LIMITS["docs_text_bytes"], (
        f"docs/ holds {size:,} bytes of text: cut narrative, keep reference")


def test_results_set_stays_small() -> None:
    assert counts_tool.result_files() <= counts_tool.LIMITS["result_files"], (
        "benchmarks/results/ keeps only what docs/performance.md reads")


def test_every_report_module_named_exists() -> None:
    missing = [m for m in counts_tool.REPORT_MODULES if not (counts_tool.PACKAGE / m).exists()]
    assert not missing, f"renamed or deleted: update REPORT_MODULES ({missing})"


def test_measurement_and_report_code_is_at_most_a_quarter_of_the_package() -> None:
    measured, total = counts_tool.measurement_share()
    assert measured / total <= counts_tool.LIMITS["measurement_share"], (
        f"bench/ + report code is {measured} of {total} lines ({measured / total:.1%}); move "
        "investigations that answered their question out of src/everystop (tools/ or git log)")


def test_the_counters_see_what_they_count(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "core.py").write_text("a = 1\n" * 30)
    (tmp_path / "bench" / "x.py").write_text("b = 2\n" * 10)
    (tmp_path / "plots.py").write_text("c = 3\n" * 10)
    assert counts_tool.measurement_share(tmp_path) == (20, 50)
    (tmp_path / "docs").mkdir()
    diary = "In " + "session" + " 12 we tried.\n"  # split, so this file holds no such line
    (tmp_path / "docs" / "a.md").write_text(diary)
    (tmp_path / "docs" / "plot.png").write_bytes(b"x" * 1000)
    assert counts_tool.session_numbers(tmp_path) == ["docs/a.md:1"]
    assert counts_tool.docs_text_bytes(tmp_path) == len(diary)
