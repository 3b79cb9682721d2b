"""Which fp32 GEMM the prefill projections should call: MKL (packed weights, or plain sgemm as
F.linear calls it) against oneDNN, on the default model's projection shapes: writes JSON.

Timed as one thread's CPU time (`time.thread_time`, best of N), not wall time: on a shared
machine a compute-bound single-thread GEMM's CPU time barely moves with the other processes,
while its wall time does. Run it again under the AVX2 narrowing (the environment variables
below must be set before torch starts) to see the AVX2 machine's choice:

    everystop bench gemm-backends --out benchmarks/results/gemm_backends_native.json
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        everystop bench gemm-backends --out benchmarks/results/gemm_backends_avx2.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

from everystop.results import write_result

# SmolLM2-135M: [out, in] of the fused projections.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)

    def cpu_best(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            t0 = time.thread_time()
            fn()
            times.append(time.thread_time() - t0)
        return min(times)

    gen = torch.Generator().manual_seed(0)
    results = []
    for rows in args.rows:
        totals: dict[str, float] = {}
        flops = 0
        for n, k in SHAPES.values():
            w = torch.randn(n, k, generator=gen) * 0.05
            x = torch.randn(rows, k, generator=gen)
            packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
            stand_in = torch.zeros(1).expand(w.shape)
            ref = F.linear(x, w)
            got = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
            candidates = {
                "mkl_packed": partial(torch.ops.mkl._mkl_linear, x, packed, stand_in, None, rows),
                "mkl_sgemm": partial(F.linear, x, w),
                "onednn": partial(torch.ops.mkldnn._linear_pointwise, x, w, None, "none", [], ""),
            }
            for name, fn in candidates.items():
                totals[name] = totals.get(name, 0.0) + cpu_best(fn)
            flops += 2 * rows * n * k
        results.append({"rows": rows, **{f"{name}_ms": round(1e3 * t, 3)
                                         for name, t in totals.items()},
                        **{f"{name}_gflops_per_thread": round(flops / t / 1e9, 1)
                           for name, t in totals.items()}})
    write_result({"bench": "gemm-backends", "timing": "one thread's CPU time, best of "
          f"{args.repeats}", "shapes": SHAPES,  # the ISA environment: the envelope's machine
          "results": results}, args.out)
    return 0
