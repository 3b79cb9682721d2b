"""docs/performance.md is the render of the committed results, and its tables follow the data
they are given."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from everystop.bench import perf_page
from everystop.cli import main


def test_the_committed_page_is_the_render_of_the_committed_results() -> None:
    assert perf_page.PAGE.read_text() == perf_page.render(), (
        "docs/performance.md differs from benchmarks/results: run "
        "`everystop bench all --render-only`")


def test_cpu_kind_names_vendor_and_the_isa_the_run_used() -> None:
    amd = {"model": "AMD EPYC", "isa_flags": ["avx2", "avx512f", "avx512_bf16"]}
    assert perf_page.cpu_kind(amd) == "amd_avx512"
    assert perf_page.cpu_kind({**amd, "isa_env": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}) == "amd_avx2"
    intel = {"model": "Intel(R) Xeon(R)", "isa_flags": ["avx2", "avx512f", "amx_bf16"]}
    assert perf_page.cpu_kind(intel) == "intel_amx"
    assert perf_page.cpu_kind({"model": "x", "isa_flags": []}) == "cpu_generic"


def _copy_results(tmp: Path) -> Path:
    results = tmp / "results"
    shutil.copytree(perf_page.RESULTS / "cpu" / "intel_amx", results / "cpu" / "intel_amx")
    return results


def test_the_tables_follow_the_numbers_in_the_results(tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    path = results / "cpu" / "intel_amx" / perf_page.VS_LLAMACPP
    data = json.loads(path.read_text())
    data["everystop"]["output_tok_s"] = 1234.5
    data["llamacpp"]["peak_rss_bytes"] = 3 * 2**30
    data["throughput_ratio"] = 9.87
    path.write_text(json.dumps(data))
    page = perf_page.render(results)
    assert "| everystop | 1,234.5 |" in page and "| 3,072 MiB |" in page
    assert "**9.87x** output tok/s" in page
    assert "## intel_amx" in page and "## amd_avx512" not in page
    assert "## Simulator" not in page  # no sim/report.json under these results


def test_bench_all_render_only_writes_the_page_next_to_other_results(tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    assert main(["bench", "all", "--out", str(results), "--render-only"]) == 0
    assert (results / "performance.md").read_text() == perf_page.render(results, results)


def test_the_startup_section_follows_its_result(tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    assert "## Start-up and memory" not in perf_page.render(results)
    (results / "startup.json").write_text(json.dumps({
        "machine": {"model": "AMD EPYC", "cpus": 2, "isa_flags": ["avx2"], "load_avg": [3.2]},
        "target": {"second_start_to_health_s_under": 10.0},
        "starts": {"first": {"to_health_s": 91.25}, "second": {"to_health_s": 7.04}},
        "single_stream": {"requests": 5, "max_tokens": 64},
        "memory_breakdown_mib": {"torch import": 201.9, "peak RSS (VmHWM)": 1419.0}}))
    page = perf_page.render(results)
    assert "load average 3 at the end" in page and "under 10 s" in page
    assert "| first (kernels, costs, tokenizer built) | 91.2 s |" in page
    assert "| second (cached) | 7.0 s |" in page
    assert "| torch import | 201.9 |" in page and "| peak RSS (VmHWM) | 1,419.0 |" in page
