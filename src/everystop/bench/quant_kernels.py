"""Quantized linear kernels against the read-bandwidth bound and against torch's own
weight-only-quantized GEMMs, side by side in one run; writes JSON.

Decode (1-8 rows): our block GEMV (csrc/quant_linear.cpp) on Q8_0/Q4_0/Q4_1 blocks and the
16-bit GEMV (`ours.*` as linear() routes each row count: the GEMV up to 32 rows), each as GB/s
of weight bytes streamed and as a fraction of the machine's read
bandwidth; torch's `_weight_int8pack_mm` (per-channel int8) and `_weight_int4pack_mm_for_cpu`
(group-32 int4) on the same shapes. Prefill (rows >= 64): our dequantize-a-tile-then-GEMM
against the same torch ops and an fp32 GEMM on a resident fp32 copy (the old path).

Decode is also timed on each integer dot path this build runs (`ours.<fmt>.path<N>`: 0 fp32
widening, 1 AVX2 maddubs, 2 AVX-VNNI, 3 AVX512-VNNI; `ours.<fmt>` is the one chosen).

    everystop bench quant-kernels --out benchmarks/results/quant_kernels.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from everystop.bench.roofline import best_time, read_bandwidth_gb_s
from everystop.executor.layers.cpu_kernels import load_cpu_kernels
from everystop.executor.layers.linear import linear
from everystop.executor.layers.quant import FORMATS, quantize
from everystop.results import write_result

# (name, out_features, in_features): the Llama-3.2-1B projections (gate/up fused).
SHAPES = [("1b.qkv", 3072, 2048), ("1b.gate_up", 16384, 2048), ("1b.down", 2048, 8192)]


def torch_int8(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    scales = w.abs().amax(1) / 127
    q = (w / scales[:, None]).round().to(torch.int8)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scales)


def torch_int4(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    try:
        n, k = w.shape
        g = w.reshape(n, k // 32, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
        q = q.reshape(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # scales_and_zeros [k/32, n, 2]; torch's zero is the value of the mid code 8.
        zeros = lo + 8 * scale
        sz = torch.stack([scale, zeros], -1).transpose(0, 1).contiguous()
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    except (RuntimeError, AttributeError):
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES),
                        help="comma-separated subset of " + ",".join(n for n, _, _ in SHAPES))
    parser.add_argument("--rows", default="1,4,8,64,256")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels("auto")
    assert kernels is not None, "the CPU kernels did not build"
    bandwidth = read_bandwidth_gb_s()
    rows_out: list[dict[str, Any]] = []
    g = torch.Generator().manual_seed(0)
    paths = [int(p) for p in kernels.ops.int_dot_paths()]
    wanted = set(args.shapes.split(","))
    for name, n, k in [s for s in SHAPES if s[0] in wanted]:
        w = torch.randn(n, k, generator=g) * 0.02
        variants: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {}
        for fmt, (code, _) in FORMATS.items():
            q = quantize(w, fmt).data
            # linear() picks the GEMV or the tiled GEMM by row count, as the model does.
            variants[f"ours.{fmt}"] = (q.numel(), lambda x, q=q, f=fmt, k=k: (
                linear(x, q, kernels, f, k)))
            for path in paths:
                variants[f"ours.{fmt}.path{path}"] = (
                    q.numel(), lambda x, q=q, c=code, k=k, p=path: (
                        kernels.ops.linear_q_small_path(x, q, c, k, p)))
        for dt in (torch.float16, torch.bfloat16):
            wd = w.to(dt)
            variants[f"ours.{str(dt)[6:]}"] = (wd.numel() * 2, lambda x, wd=wd: (
                linear(x, wd, kernels)))
        variants["torch.fp32_resident"] = (w.numel() * 4, lambda x, w=w: F.linear(x, w))
        variants["torch.int8pack_per_channel"] = (w.numel() + 4 * n, torch_int8(w))
        int4 = torch_int4(w)
        if int4 is not None:
            variants["torch.int4pack_g32"] = (w.numel() // 2 + 8 * n * k // 32, int4)
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, generator=g)
            for vname, (nbytes, fn) in variants.items():
                if ".path" in vname and rows > 8:
                    continue
                ms = best_time(lambda fn=fn, x=x: fn(x), args.repeats) * 1e3
                entry = {"shape": name, "n": n, "k": k, "rows": rows, "kernel": vname,
                         "weight_bytes": nbytes, "ms": round(ms, 4),
                         "gflops": round(2 * rows * n * k / ms / 1e6, 2)}
                if rows <= 8:
                    gbs = nbytes / ms / 1e6
                    entry["weight_gb_s"] = round(gbs, 2)
                    entry["of_read_bandwidth"] = round(gbs / bandwidth, 3)
                rows_out.append(entry)
                print(name, rows, vname, entry.get("weight_gb_s", ""), f"{ms:.3f} ms",
                      flush=True)
    write_result({"benchmark": "quant_kernels", "isa": kernels.isa, "dot_paths": paths,
                  "threads": torch.get_num_threads(),
          "read_bandwidth_gb_s": round(bandwidth, 2), "results": rows_out}, args.out)
    return 0
