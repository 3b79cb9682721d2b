"""`everystop simulate calibrate`: fit the simulator's cost model to an engine's measured
iterations, then predict another workload.

1. Measure iterations of the real engine (any workload; a few dozen passes of varied shape are
   enough - `everystop.sim.fit.profile_shapes()` lists useful ones). Write them as a JSON list of
   {"num_decode_tokens", "num_prefill_tokens", "context_tokens_read", "latency_s"} (plus
   "num_seqs", "attention_pairs", "num_sampled" if available: log
   `IterationShape.from_scheduler_output(out).to_dict()` and the measured seconds per step).
2. Run a *different* workload through the real engine and write its measured summary
   {"output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms"}.
3. everystop simulate calibrate --records iters.json --workload W.json \
       --measured summary.json --out benchmarks/results/sim/calibration.json

It fits latency = max(a*flops, b*bytes) + c0 + c1*num_seqs by least squares, runs the
workload through the simulator (the real scheduler) with the fitted model, and reports the
prediction error against the measured summary (goal: within 10%).

`--self-test` does all of this against a hidden "true" CPU cost model with +/-10% per-pass noise
standing in for the engine, so the pipeline can be checked without one. (`everystop bench
sim-calibrate` does steps 1-3 on this machine's engine.)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from everystop.config import SchedulerConfig
from everystop.results import write_result
from everystop.sim.cost_model import Coefficients, CostModel
from everystop.sim.fit import fit_coefficients, load_records, profile_shapes
from everystop.sim.metrics import summarize
from everystop.sim.simulator import SimSetup, simulate
from everystop.sim.specs import ModelSpec, load_model
from everystop.workload import Workload, resolve_workload

KEYS = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
# Stand-in for the real engine in --self-test: roughly a 2-core CPU running SmolLM2 in fp32.
TRUE_CPU = Coefficients(sec_per_flop=1 / 25e9, sec_per_byte=1 / 6e9, overhead_s=0.004,
                        overhead_per_seq_s=3e-4)


def cpu_setup(model: ModelSpec, args: argparse.Namespace) -> SimSetup:
    """The engine's CPU defaults: a KV pool of kv_cache_memory bytes (CacheConfig)."""
    blocks = args.num_gpu_blocks or int(args.kv_cache_memory // (16 * model.kv_bytes_per_token))
    cfg = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          chunk_size=args.chunk_size, max_model_len=args.max_model_len,
                          # Calibration compares cost models on one fixed policy: under a TPOT
                          # target the schedule itself would follow each run's fitted cost.
                          tpot_target_ms=0.0)
    return SimSetup(cfg, num_gpu_blocks=blocks)


def predict(model: ModelSpec, coeffs: Coefficients, workload: Workload, setup: SimSetup) -> dict:
    cost = CostModel(model, 1, coeffs)
    return summarize(simulate(workload, setup, cost.latency))


def errors(pred: dict, measured: dict) -> dict:
    return {k: (pred[k] - measured[k]) / measured[k] for k in KEYS
            if measured.get(k) and pred.get(k) is not None}


def self_test(model: ModelSpec, workload: Workload, setup: SimSetup, seed: int) -> dict:
    rng = random.Random(seed)
    true = CostModel(model, 1, TRUE_CPU)
    records = [{**s.to_dict(), "latency_s": true.latency(s) * rng.uniform(0.9, 1.1)}
               for s in profile_shapes() for _ in range(2)]
    noisy = lambda s: true.latency(s) * rng.uniform(0.9, 1.1)  # noqa: E731
    measured = summarize(simulate(workload, setup, noisy))
    return {"records": records, "measured": {k: measured[k] for k in KEYS},
            "true_coefficients": TRUE_CPU.to_dict()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--records", type=Path, help="measured iterations JSON")
    p.add_argument("--measured", type=Path, help="measured summary JSON of --workload")
    p.add_argument("--workload", default="n=80,prompt=uniform:16:256,output=uniform:8:64,"
                                         "rate=0.25,seed=11")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=float, default=float(1 << 30))
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--self-test", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)


def run(args: argparse.Namespace) -> int:

    model = load_model(args.model)
    workload = resolve_workload(args.workload)
    setup = cpu_setup(model, args)
    report: dict = {"model": model.key, "workload": workload.name}
    if args.self_test:
        synthetic = self_test(model, workload, setup, args.seed)
        records, measured = synthetic["records"], synthetic["measured"]
        report["mode"] = "self-test (synthetic engine)"
        report["true_coefficients"] = synthetic["true_coefficients"]
    else:
        if not args.records:
            raise SystemExit("everystop simulate calibrate: --records is required unless "
                             "--self-test")
        records = load_records(args.records)
        measured = json.loads(args.measured.read_text()) if args.measured else None
        report["mode"] = "measured"
    coeffs, stats = fit_coefficients(model, records)
    pred = predict(model, coeffs, workload, setup)
    report.update(fitted_coefficients=coeffs.to_dict(), fit=stats,
                  predicted={k: pred[k] for k in KEYS})
    if measured:
        report["measured"] = {k: measured.get(k) for k in KEYS}
        report["relative_error"] = errors(pred, measured)
        report["within_10pct"] = all(abs(e) <= 0.10 for k, e in report["relative_error"].items()
                                     if k in KEYS[:3])
    write_result(report, args.out)
    return 0
