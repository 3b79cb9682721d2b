"""Where one engine iteration's time goes, at 128 running sequences: writes JSON.

Drives the engine's loop by hand on the mixed workload (schedule -> execute -> finish_step),
timing each part of every step. Picks the first step that has 128 sequences *and* a prefill
chunk, re-executes that same SchedulerOutput several times (re-running a step rewrites the same
KV slots with the same values, so it is repeatable) for a min-of-N wall time, and once under
torch.profiler to split it into: linear layers, lm_head, attention, KV write, other tensor ops
(norms, rope, activations, residuals), input preparation, sampling and Python overhead.

    everystop bench profile --dtype float32 --out benchmarks/results/profile_fp32.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from typing import Any

from everystop.bench.throughput import add_engine_arguments, engine_options
from everystop.results import write_result

# Our kernels' ops live in one namespace per ISA build (everystop_avx2::..., ...): they are
# matched as "everystop::<op>".
LINEAR_OPS = {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm",
              "mkl::_mkl_linear", "mkldnn::_linear_pointwise", "everystop::linear_small"}
ATTENTION_OPS = {"everystop::paged_attention"}
# Decode-sized steps run every layer in this one op (linear, attention and the small ops
# together); --no-decoder-stack splits it back into the layers' ops.
STACK_OPS = {"everystop::decoder_stack", "everystop::decoder_stack_ext"}
KV_WRITE_OPS = {"aten::index_copy_", "everystop::write_kv"}


def _op_name(name: str) -> str:
    namespace, sep, op = name.partition("::")
    return f"everystop::{op}" if sep and namespace.startswith("everystop_") else name
# Ranges added by this profiler; anything under them is charged to them whole.
RANGES = {"build_inputs": "input_prep", "sampler": "sampling", "lm_head": "lm_head",
          "forward": "python_overhead", "step": "python_overhead"}


def _instrument(runner: Any) -> None:
    """Wrap the runner's parts in profiler ranges (this profile only; the engine stays bare)."""
    import torch

    from everystop.executor import model_runner as mr

    def ranged(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            with torch.profiler.record_function(name):
                return fn(*a, **k)
        return wrapper

    mr.build_inputs = ranged("build_inputs", mr.build_inputs)
    runner.sampler = ranged("sampler", runner.sampler)
    model = runner.model
    model.compute_logits = ranged("lm_head", model.compute_logits)
    model.forward = ranged("forward", model.forward)


def _categorize(events: Any) -> dict[str, float]:
    """Self time (ms) per category, walking the profiler's event tree from its roots."""
    acc: dict[str, float] = defaultdict(float)

    def walk(ev: Any, inherited: str) -> None:
        name = _op_name(ev.name)
        if inherited in ("input_prep", "sampling", "lm_head"):
            cat = inherited
        elif name in RANGES:
            cat = RANGES[name]
        elif name in LINEAR_OPS:
            cat = "linear"
        elif name in ATTENTION_OPS:
            cat = "attention"
        elif name in KV_WRITE_OPS:
            cat = "kv_write"
        elif name in STACK_OPS:
            cat = "decoder_stack"
        elif inherited in ("linear", "attention", "kv_write", "decoder_stack"):
            cat = inherited
        else:
            cat = "other_ops"
        acc[cat] += ev.self_cpu_time_total / 1000.0
        for child in ev.cpu_children:
            walk(child, cat)

    for ev in events:
        if ev.cpu_parent is None:
            walk(ev, "python_overhead")
    return dict(acc)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_engine_arguments(ap)
    ap.add_argument("--tpot-target-ms", type=float, default=0.0,
                    help="0 = the fixed token budget (as the committed profiles ran)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-steps", type=int, default=60, help="stop the run after this many")
    ap.add_argument("--single", action="store_true",
                    help="one request alone (a ~280-token prompt): profile its 32nd decode step, "
                    "then serve it through the server's engine path for microseconds per part "
                    "(bench/step_parts.py)")
    ap.add_argument("--decode-steps", type=int, default=64,
                    help="--single: decode steps timed on the serving path")
    ap.add_argument("--no-decoder-stack", dest="decoder_stack", action="store_false",
                    help="decode steps layer by layer (the breakdown then splits linear, "
                    "attention and the small ops)")
    ap.add_argument("--out")


def run(args: argparse.Namespace) -> int:

    # NOTE: everystop before torch, so its OpenMP wait policy applies (see everystop/__init__).
    import torch

    from everystop import LLM, SamplingParams
    from everystop.workload import perf_workload

    llm = LLM(**engine_options(args, max_num_seqs=128, tpot_target_ms=args.tpot_target_ms,
                               decoder_stack=args.decoder_stack))
    engine = llm.engine
    runner = engine.executor.runner
    workload = perf_workload().to_dict()
    requests = workload["requests"]
    if args.single:
        requests = [max(requests, key=lambda r: r["prompt_len"] if r["prompt_len"] <= 300 else 0)]
        requests[0] = dict(requests[0], max_tokens=64)
    for i, r in enumerate(requests):
        engine.add_request(r["prompt_token_ids"], SamplingParams(
            max_tokens=r["max_tokens"], temperature=0.0, seed=i, ignore_eos=True))
    # The step to profile: a mixed step at 128 sequences, or (--single) the 32nd decode step.
    def wanted(sched: Any, step: int) -> bool:
        if args.single:
            return step == 32
        return len(sched.scheduled) == 128 and sched.num_prefill_tokens > 0

    steps: list[dict[str, Any]] = []
    picked: dict[str, Any] | None = None
    while engine.has_unfinished_requests() and len(steps) < args.max_steps:
        t0 = time.perf_counter()
        sched = engine.scheduler.schedule()
        t1 = time.perf_counter()
        if sched.is_empty:
            continue
        if picked is None and wanted(sched, len(steps)):
            picked = _profile(engine, runner, sched, args.repeats)
        t2 = time.perf_counter()
        result = engine.executor.execute(sched)
        t3 = time.perf_counter()
        engine.finish_step(sched, result, t0)
        t4 = time.perf_counter()
        steps.append({"seqs": len(sched.scheduled), "prefill": sched.num_prefill_tokens,
                      "decode": sched.num_decode_tokens, "schedule_ms": 1e3 * (t1 - t0),
                      "execute_ms": 1e3 * (t3 - t2), "update_ms": 1e3 * (t4 - t3)})

    serving = None
    if args.single and picked is not None:
        picked["weight_stream"] = _weight_stream(engine, picked)
        serving = _serving_parts(args, requests[0]["prompt_token_ids"])
    full = [s for s in steps if s["seqs"] == 128]
    decode_only = [s for s in full if s["prefill"] == 0]

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        return sum(r[key] for r in rows) / max(len(rows), 1)

    out = {"dtype": args.dtype, "activation_dtype": str(runner.dtype).removeprefix("torch."),
           "threads": torch.get_num_threads(), "single": args.single,
           "cpu_kernels": runner.backends.kernels.isa if runner.backends.kernels else "off",
           "kv_cache": engine.executor.describe_capacity(),
           "load_avg": os.getloadavg(), "num_steps": len(steps),
           "mixed_step": picked, "serving_step": serving,
           "steps_at_128": {"count": len(full), "decode_only_count": len(decode_only),
                            **{f"mean_{k}": mean(full, k) for k in
                               ("schedule_ms", "execute_ms", "update_ms", "prefill")}},
           "decode_steps_at_128": {f"mean_{k}": mean(decode_only, k) for k in
                                   ("schedule_ms", "execute_ms", "update_ms")}}
    write_result(out, args.out)
    return 0


def _serving_parts(args: argparse.Namespace, prompt_ids: list[int]) -> dict[str, Any]:
    """The single stream served through AsyncEngine (a second engine on its own thread, as
    the server builds it), per-part microseconds per decode step."""
    from everystop.bench.step_parts import measure_in_subprocess

    options = engine_options(args, decoder_stack=args.decoder_stack)
    parts = measure_in_subprocess(options, prompt_ids, args.decode_steps)
    print(f"serving step: period {parts['period_us_median']:.0f} us (median), kernels "
          f"{parts['kernels_us']:.0f} us, everything else {parts['everything_else_us']:.0f} us:"
          f" {parts['engine_thread_us']}; event loop {parts['event_loop_us']}", file=sys.stderr)
    return parts


def _weight_stream(engine: Any, picked: dict[str, Any]) -> dict[str, Any]:
    """A single-stream decode step reads its weights once (every dense weight, one embedding
    row, an MoE block's chosen experts; as the model counted them for the step), and its
    sequence's K/V: the weight bytes over the step's time (min wall, and the weight kernels'
    profiled time alone), against the read bandwidth measured right after, same threads."""
    from everystop.bench.roofline import read_bandwidth_gb_s

    weight_bytes = picked["weight_bytes_per_step"] or engine.executor.weight_bytes
    read_gb_s = read_bandwidth_gb_s()
    step_gb_s = weight_bytes / picked["execute_ms_min"] / 1e6
    kernels_ms = sum(picked["breakdown_ms"].get(k, 0.0) for k in
                     ("decoder_stack", "lm_head", "linear"))
    kernels_gb_s = weight_bytes / kernels_ms / 1e6 if kernels_ms else None
    return {"weight_bytes": engine.executor.weight_bytes,
            "weight_bytes_per_step": weight_bytes, "read_bandwidth_gb_s": read_gb_s,
            "step_gb_s": step_gb_s, "step_share_of_read_bandwidth": step_gb_s / read_gb_s,
            "weight_kernels_ms": kernels_ms, "weight_kernels_gb_s": kernels_gb_s,
            "weight_kernels_share_of_read_bandwidth":
                kernels_gb_s / read_gb_s if kernels_gb_s else None,
            "note": "step: the whole execute() (Python, sampling, attention included); "
                    "kernels: decoder stack (+ its attention) and LM head, profiled"}


def _profile(engine: Any, runner: Any, sched: Any, repeats: int) -> dict[str, Any]:
    import torch

    execute = engine.executor.execute
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        execute(sched)
        walls.append(time.perf_counter() - t0)
    _instrument(runner)
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
          torch.profiler.record_function("step")):
        t0 = time.perf_counter()
        execute(sched)
        profiled_wall = time.perf_counter() - t0
    # The weight bytes that step read (a sparse MoE model: its chosen experts only).
    step_bytes = runner.weight_bytes_last_pass() if runner is not None else None
    cats = _categorize(prof.events())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15),
          file=sys.stderr)
    total = sum(cats.values())
    return {"num_seqs": len(sched.scheduled), "prefill_tokens": sched.num_prefill_tokens,
            "decode_tokens": sched.num_decode_tokens,
            "execute_ms_min": 1e3 * min(walls), "execute_ms_all": [1e3 * w for w in walls],
            "profiled_wall_ms": 1e3 * profiled_wall, "weight_bytes_per_step": step_bytes,
            "breakdown_ms": {k: round(v, 3) for k, v in sorted(cats.items(),
                                                                key=lambda kv: -kv[1])},
            "breakdown_frac": {k: round(v / total, 4) for k, v in sorted(
                cats.items(), key=lambda kv: -kv[1])}}
