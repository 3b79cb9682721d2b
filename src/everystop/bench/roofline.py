"""This machine's roofline (matmul peak in fp32 and bf16, memory bandwidth) and where a benchmark
result sits under it: MFU and the bound (compute or weight bandwidth) that limits it.

    everystop bench roofline --out benchmarks/results/roofline.json            # measure
    everystop bench roofline --peaks benchmarks/results/roofline.json R.json   # annotate

A result is a JSON from `everystop bench throughput` (mode workload or single). The model cost
(default SmolLM2-135M) per prompt token is 2 x non-embedding weights; a sampled token adds the
lm_head (2 x hidden x vocab). Attention FLOPs are left out, so the bound is optimistic. The weight
bandwidth bound charges one full read of the weights per engine step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from everystop.results import write_result

# SmolLM2-135M: 30 layers of (qkv 576x960, o 576x576, gate_up 576x3072, down 1536x576).
HIDDEN, VOCAB, LAYERS = 576, 49152, 30
NON_EMBED_PARAMS = LAYERS * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
LM_HEAD_PARAMS = HIDDEN * VOCAB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def best_time(fn: Any, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `fn`, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(repeats: int = 7) -> dict[str, Any]:
    """Matmul GFLOP/s (a large square and the model's own shapes at 2048 tokens) per dtype,
    and copy bandwidth."""
    import torch

    import everystop  # noqa: F401 - before torch: the engine's OpenMP wait policy

    out: dict[str, Any] = {"threads": torch.get_num_threads(), "torch": torch.__version__,
                           "load_avg": os.getloadavg(), "matmul_gflops": {}}
    shapes = {"square_2048": (2048, 2048, 2048), "gate_up_T2048": (2048, 576, 3072),
              "down_T2048": (2048, 1536, 576), "lm_head_T128": (128, 576, VOCAB)}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        res = {}
        for label, (m, k, n) in shapes.items():
            a = torch.randn(m, k, dtype=dtype)
            w = torch.randn(n, k, dtype=dtype)
            # the lambda runs within this iteration, so a and w are the ones meant
            t = best_time(lambda: torch.nn.functional.linear(a, w), repeats)  # noqa: B023
            res[label] = 2 * m * k * n / t / 1e9
        res["peak"] = max(res.values())
        out["matmul_gflops"][name] = res
    src = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)  # 256 MiB
    dst = torch.empty_like(src)
    t = best_time(lambda: dst.copy_(src), repeats)
    out["copy_gb_s"] = 2 * src.numel() * 4 / t / 1e9  # read + write
    t = best_time(lambda: src.sum(), repeats)
    out["read_gb_s"] = src.numel() * 4 / t / 1e9
    return out


def model_flops(prompt_tokens: int, output_tokens: int) -> float:
    return 2.0 * NON_EMBED_PARAMS * (prompt_tokens + output_tokens) + \
        2.0 * LM_HEAD_PARAMS * output_tokens


def annotate(result: dict[str, Any], peaks: dict[str, Any]) -> dict[str, Any]:
    """MFU and bounds for one throughput.py result."""
    dtype = result.get("dtype", "float32")
    # The engine multiplies 16-bit weights in fp32 on CPUs where that is faster (linear.py:
    # without AMX a bf16 GEMM runs at about half the fp32 rate), so the binding compute peak
    # for any dtype is the faster of its own and fp32's.
    rates = peaks["matmul_gflops"]
    peak_dtype = max((d for d in (dtype, "float32") if d in rates),
                     key=lambda d: rates[d]["peak"])
    peak = rates[peak_dtype]
    peak_flops = peak["peak"] * 1e9
    weight_bytes = (NON_EMBED_PARAMS + LM_HEAD_PARAMS) * DTYPE_BYTES[dtype]
    bw = peaks["read_gb_s"] * 1e9
    if "decode_ms_per_token_mean" in result:  # single stream: one token per step
        step_s = result["decode_ms_per_token_mean"] / 1e3
        flops = model_flops(0, 1)
        compute_s, memory_s = flops / peak_flops, weight_bytes / bw
        bound_s = max(compute_s, memory_s)
        return {"dtype": dtype, "mfu": flops / step_s / peak_flops,
                "compute_bound_ms": 1e3 * compute_s, "weight_bandwidth_bound_ms": 1e3 * memory_s,
                "bound": "weight bandwidth" if memory_s >= compute_s else "compute",
                "fraction_of_bound": bound_s / step_s}
    elapsed = result["elapsed_s"]
    flops = model_flops(result["prompt_tokens"], result["output_tokens"])
    compute_s = flops / peak_flops
    memory_s = result.get("num_steps", 0) * weight_bytes / bw
    bound_s = max(compute_s, memory_s)
    return {"dtype": dtype, "model_gflop": flops / 1e9, "achieved_gflops": flops / elapsed / 1e9,
            "peak_gflops": peak["peak"], "peak_of": peak_dtype,
            "mfu": flops / elapsed / peak_flops,
            "compute_bound_s": compute_s, "weight_bandwidth_bound_s": memory_s,
            "bound": "compute" if compute_s >= memory_s else "weight bandwidth",
            "bound_output_tok_s": result["output_tokens"] / bound_s,
            "fraction_of_bound": bound_s / elapsed}


def read_bandwidth_gb_s(mib: int = 512, repeats: int = 5) -> float:
    """Best-of-`repeats` read bandwidth: a sum over `mib` MiB of fp32 (larger than any cache),
    with torch's threads."""
    import torch

    src = torch.ones(mib << 18, dtype=torch.float32)
    return src.numel() * 4 / best_time(lambda: src.sum(), repeats) / 1e9


def load_peaks(path: str) -> dict[str, Any]:
    """The peaks of a roofline JSON from an earlier run (a whole report, or just its peaks)."""
    with open(path) as f:
        peaks: dict[str, Any] = json.load(f)
    return peaks.get("roofline") or peaks


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("results", nargs="*", help="throughput JSON results to annotate")
    ap.add_argument("--peaks", help="a roofline JSON from an earlier run (else measure now)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", help="write the measured roofline (and annotations) here")


def run(args: argparse.Namespace) -> int:
    peaks = load_peaks(args.peaks) if args.peaks else measure(args.repeats)
    report: dict[str, Any] = {"roofline": peaks, "results": {}}
    for path in args.results:
        with open(path) as f:
            report["results"][path] = annotate(json.load(f), peaks)
    write_result(report, args.out)
    return 0
