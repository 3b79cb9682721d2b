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


def _served_run(tok_s: float, tpot_ms: float, rss_mib: float, share: float) -> dict:
    return {"command": ["x"], "output_throughput": tok_s, "start_to_health_s": 4.0,
            "tpot_ms": {"p50": tpot_ms}, "ttft_ms": {"p50": 100.0},
            "peak_rss_bytes": rss_mib * 2**20, "bound_share": share}


def test_the_served_table_reads_both_servers_and_their_ratio(tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    served = {"bench": "served", "command": "everystop bench served",
              "machine": {"model": "Intel"}, "read_bandwidth_gb_s": 31.5,
              "concurrent": {"num_requests": 128, "everystop": _served_run(300.0, 0, 1, 0),
                             "llamacpp": _served_run(100.0, 0, 1, 0)},
              "single": {"everystop": _served_run(0, 6.0, 500, 0.45),
                         "llamacpp": _served_run(0, 8.0, 400, 0.34)}}
    path = results / "cpu" / "intel_amx" / perf_page.SERVED["F16"]
    path.write_text(json.dumps(served))
    page = perf_page.render(results)
    assert "| F16 | 128 at once, output tok/s | 300.0 | 100.0 | 3.00x |" in page
    assert "| F16 | single stream, TPOT p50 (ms) | 6.00 | 8.00 | 0.75x |" in page
    assert "| F16 | single stream, peak RSS (MiB) | 500 | 400 | 1.25x |" in page
    assert "| F16 | single stream, share of the bound at 31.5 GB/s | 0.45 | 0.34 | 1.32x |" in page


def test_a_served_run_without_llamacpp_fills_everystop_only(tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    served = {"bench": "served", "command": "everystop bench served --scenarios single",
              "machine": {"model": "Intel"}, "read_bandwidth_gb_s": 31.5,
              "single": {"everystop": _served_run(0, 6.0, 500, 0.45)}}
    path = results / "cpu" / "intel_amx" / perf_page.SERVED["Q4_1 (shipped)"]
    path.write_text(json.dumps(served))
    page = perf_page.render(results)
    assert "| Q4_1 (shipped) | single stream, TPOT p50 (ms) | 6.00 | - | - |" in page
    assert "| Q4_1 (shipped) | start to /health (s) | 4.0 | - | - |" in page
    assert "at once" not in page.split("## intel_amx")[1].split("\n## ")[0]


def _spec_run(engine: str, method: str, tok_s: float, ttft_p99_ms: float,
              acceptance: float | None) -> dict:
    """A speculative run: llama.cpp's from a server for single streams and one for many
    (`commands`), everystop's from one server for all (named once, as `command`)."""
    scenario = {"output_tok_s": tok_s, "ttft_ms": {"p99": ttft_p99_ms}}
    servers = ({"commands": [f"{engine} --{method}", f"{engine} --{method} -np 32"]}
               if engine == "llamacpp" else {"command": f"{engine} --{method}"})
    return {"engine": engine, "method": method, **servers, "acceptance_rate": acceptance,
            "scenarios": {n: scenario for n in ("grounded_single", "chat_single",
                                                "grounded_concurrent")}}


def test_the_speculative_section_shows_each_method_against_its_server_without(
        tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    kind = results / "cpu" / "intel_amx"
    machine = json.loads((kind / perf_page.VS_LLAMACPP).read_text())["machine"]
    runs = {"everystop/off": _spec_run("everystop", "off", 10.0, 900.0, None),
            "everystop/ngram": _spec_run("everystop", "ngram", 25.0, 800.0, 0.6),
            "llamacpp/off": _spec_run("llamacpp", "off", 40.0, 700.0, None),
            "llamacpp/draft": _spec_run("llamacpp", "draft", 30.0, 1200.0, None)}
    (kind / perf_page.SPECULATIVE).write_text(json.dumps({
        "command": "everystop bench speculative", "machine": machine, "runs": runs,
        "target": "/x/f16.gguf", "draft": "/x/q4_1.gguf", "num_speculative_tokens": 4,
        "dtype": "float32", "same_tokens_as_off": {"everystop": {"ngram": False}},
        "scenarios": {"grounded_concurrent": {"concurrency": 32}}}))
    page = perf_page.render(results)
    assert "### Speculative decoding" in page and "grounded, 32 streams" in page
    assert "| everystop | off | 10.0 tok/s | 10.0 tok/s | 10.0 tok/s | 900 ms | n/a |" in page
    assert "| everystop | ngram | 25.0 tok/s (2.50x) |" in page and "| 800 ms | 60% |" in page
    assert "| llama.cpp | draft | 30.0 tok/s (0.75x) |" in page
    assert "(everystop): ngram no." in page and "llamacpp --draft\n" in page
    assert "llamacpp --draft -np 32\n" in page and "everystop --ngram\n" in page
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


def test_the_lora_section_reads_base_and_adapter_throughput(tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    kind = results / "cpu" / "intel_amx"
    machine = json.loads((kind / perf_page.VS_LLAMACPP).read_text())["machine"]
    (kind / perf_page.LORA).write_text(json.dumps({
        "command": "everystop bench lora", "machine": machine, "repeats": 3, "streams": 32,
        "adapters": 8, "rank": 16, "median_output_tok_s": {"base": 200.0, "lora": 170.0},
        "lora_over_base": 0.85, "target": {"lora_over_base_output_throughput_at_least": 0.8},
        "failed_requests": 0, "serve_command": ["everystop", "serve", "--lora", "a=x"]}))
    page = perf_page.render(results)
    assert "| 32 streams over 8 rank-16 adapters | 170.0 |" in page
    assert "Adapters / base: **0.85x** (target at least 0.80x)" in page
