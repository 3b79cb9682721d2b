"""Does structured output slow requests that do not use it? The 128-request workload (no
grammar anywhere) through the engine as shipped vs the same engine with its structured-output
hook (fill_bitmasks) replaced by a no-op, alternating in one process; writes
benchmarks/results/grammar_off_throughput.json.

    PYTHONPATH=src python scripts/grammar_off_ab.py [ROUNDS]
"""
import sys

from everystop import LLM
from everystop.bench.throughput import run_workload, warm_up_workload
from everystop.results import write_result
from everystop.workload import perf_workload

llm = LLM(dtype="bfloat16", quantization="none", max_num_seqs=128, kv_cache_memory=3 << 30,
          tpot_target_ms=0)
wl = perf_workload(128)
run_workload(llm, warm_up_workload(wl), 0.0)
real = llm.engine.structured.fill_bitmasks
runs = {"with_hook": [], "hook_removed": []}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for name in (("with_hook", "hook_removed") if rnd % 2 == 0 else ("hook_removed", "with_hook")):
        off = lambda *a, **k: None  # noqa: E731
        llm.engine.structured.fill_bitmasks = real if name == "with_hook" else off
        r = run_workload(llm, wl, 0.0)
        runs[name].append(r["output_tok_s"])
        print(name, round(r["output_tok_s"], 1), flush=True)
out = {"workload": "perf-mixed-128 at t=0, no request with a grammar", "dtype": "bfloat16",
       "output_tok_s": runs, "ratio_best": max(runs["with_hook"]) / max(runs["hook_removed"])}
write_result(out, "benchmarks/results/grammar_off_throughput.json")
