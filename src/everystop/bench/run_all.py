"""`everystop bench all`: this machine's canonical results and docs/performance.md.

    everystop bench all --out benchmarks/results [--quick] [--llama-server PATH [--gguf F16]
                        [--f16-gguf F16]]

Writes OUT/cpu/KIND/ (KIND: this CPU's vendor and ISA, `perf_page.cpu_kind`): the offline
128-request throughput, `everystop serve`'s single stream with no flags (`bench served`),
latency under Poisson load and, with a llama-server, the same against llama.cpp, 128 concurrent
requests head to head, and `bench served` on an F16 copy of the shipped file too. Without
--quick it also reruns the simulator's report (`everystop simulate report`). Then it renders the
performance page from OUT: docs/performance.md when OUT is the committed results, else
OUT/performance.md. --quick runs small versions of each measurement (minutes; its numbers are a
smoke test, not results).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from everystop.bench import perf_page
from everystop.results import cpu_info

WORKLOADS = perf_page.ROOT / "benchmarks/workloads"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=perf_page.RESULTS, help="results directory")
    ap.add_argument("--quick", action="store_true", help="small runs, a few minutes in all")
    ap.add_argument("--llama-server", help="a llama-server binary: measure llama.cpp too")
    ap.add_argument("--gguf", help="the GGUF llama.cpp serves (default: the default model's)")
    ap.add_argument("--f16-gguf", help="an F16 GGUF of the default model for `bench served` "
                    "(default: one written from the shipped file, bench/gguf_f16.py)")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="everystop's dtype; auto: bfloat16 where the CPU has bf16 units")
    ap.add_argument("--render-only", action="store_true",
                    help="only render the page from the results under --out")


def default_dtype(machine: dict[str, Any]) -> str:
    flags = set(machine.get("isa_flags", []))
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def _cli(argv: list[str]) -> None:
    """One `everystop bench ...` or `everystop simulate ...` command, recorded in its result as
    itself (the result's envelope reads argv)."""
    from everystop.bench.cli import register as register_bench
    from everystop.sim.cli import register as register_simulate

    print("+ everystop " + " ".join(argv), flush=True)
    parser = argparse.ArgumentParser(prog="everystop")
    sub = parser.add_subparsers(dest="command")
    (register_bench if argv[0] == "bench" else register_simulate)(sub)
    args = parser.parse_args(argv)
    saved, sys.argv = sys.argv, ["everystop", *argv]
    try:
        code = int(args.func(args) or 0)
    finally:
        sys.argv = saved
    if code:
        raise SystemExit(f"everystop {' '.join(argv)} exited {code}")


def _threads() -> int:
    return len(os.sched_getaffinity(0))


def _gguf(args: argparse.Namespace) -> str:
    if args.gguf:
        return str(args.gguf)
    from everystop.executor.models.loader import default_model_path
    return default_model_path()


def measure_cpu(out_dir: Path, dtype: str, args: argparse.Namespace) -> None:
    """Every CPU measurement, each writing its result under out_dir."""
    quick = args.quick
    _cli(["bench", "throughput", "--dtype", dtype, "--out", str(out_dir / perf_page.THROUGHPUT)]
         + (["--num-requests", "12"] if quick else []))
    llama = ["--llama-server", args.llama_server, "--gguf", _gguf(args)] \
        if args.llama_server else []
    from everystop.executor.models.loader import default_model_path

    files = {"Q4_1 (shipped)": default_model_path()}
    if llama:
        from everystop.bench.gguf_f16 import default_model_f16

        files["F16"] = args.f16_gguf or str(default_model_f16())
    # `bench served` measures the single stream (and, beside llama.cpp, 128 at once).
    for label, gguf in files.items():
        _cli(["bench", "served", "--gguf", gguf, "--out", str(out_dir / perf_page.SERVED[label])]
             + (["--llama-server", args.llama_server] if llama else ["--scenarios", "single"])
             + (["--num-requests", "8", "--single-requests", "2"] if quick else []))
    if llama:
        _cli(["bench", "vs-llamacpp", *llama, "--dtype", dtype,
              "--out", str(out_dir / perf_page.VS_LLAMACPP)]
             + (["--num-requests", "12"] if quick else []))
    threads = str(_threads())
    sweep = ["bench", "sweep", "--start-everystop", f"--dtype {dtype}",
             "--workload", str(WORKLOADS / "mixed-128.json"), "--token-ids",
             "--num-requests", "8" if quick else "48", "--warmup-requests", "1" if quick else "8",
             "--out", str(out_dir / perf_page.LOAD_SWEEP)]
    if llama:
        sweep += ["--start-llamacpp", f"-np 32 -c 65536 -t {threads} -tb {threads}", *llama,
                  "--capacity-from", "llamacpp"]
    else:
        sweep += ["--capacity-from", "everystop"]
    _cli(sweep + (["--loads", "0.5"] if quick else []))


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if not args.render_only:
        machine = cpu_info()
        dtype = default_dtype(machine) if args.dtype == "auto" else args.dtype
        measure_cpu(out / "cpu" / perf_page.cpu_kind(machine), dtype, args)
        if not args.quick and out.resolve() == perf_page.RESULTS.resolve():
            _cli(["simulate", "report"])  # writes the committed sim/report.json
    page = perf_page.PAGE if out.resolve() == perf_page.RESULTS.resolve() \
        else out / "performance.md"
    page.write_text(perf_page.render(out, page.parent))
    print(f"wrote {page}")
    return 0
