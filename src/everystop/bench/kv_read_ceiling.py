"""How fast can K/V be read in paged order at all? The ceiling a paged-attention kernel works
under, per block size, beside the kernel itself.

For the attention bench's decode scenario (128 sequences x 250-350 tokens, SmolLM2-135M's
attention shape, blocks scattered through a pool 4x larger than needed, 8 layers) and each
block size, three readers of the same K/V bytes in the same order run interleaved with a
sequential read of as many bytes (the machine's read bandwidth, measured in the same round):

  paged_read:    every byte of each sequence's K and V blocks, block-table order, next block
                 prefetched (no arithmetic: what the access pattern alone allows)
  contiguous:    the same bytes with each sequence's blocks adjacent (the layout's own cost)
  kernel-ISA:    the paged-attention kernel on those blocks (and the best ISA's on the
                 adjacent blocks: what an allocator keeping sequences contiguous would buy)

Each reports its share of the sequential read (median over rounds: the machine is shared, so
each round's ratio is taken within the same seconds). Tells apart "the kernel is slow" from
"small scattered blocks cannot be streamed faster".

    everystop bench kv-read-ceiling [--block-sizes 16,32,64,128] [--rounds 7] [--threads N]

Writes benchmarks/results/kv_read_ceiling.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from typing import Any

from everystop.bench import attention_kernels as ak
from everystop.results import write_result

# A reader that sums every K and V byte of each sequence's blocks in block-table order, one
# OpenMP task per sequence as the kernel splits decode work; `next_block` asks for the next
# block's lines at the start of each block, as the kernel does.
_READER_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <omp.h>
#include <cstdint>
#include <cstring>

double read_blocks(const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                   const at::Tensor& num_blocks, bool next_block) {
  const int64_t seqs = tables.size(0), width = tables.size(1);
  const int64_t stride = k.stride(0) * k.element_size();
  const int64_t bytes = k.size(1) * k.size(2) * k.size(3) * k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t* t = tables.data_ptr<int64_t>();
  const int64_t* n = num_blocks.data_ptr<int64_t>();
  double total = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : total)
  for (int64_t s = 0; s < seqs; ++s) {
    typedef float v8 __attribute__((vector_size(32)));
    v8 acc{};
    for (int64_t b = 0; b < n[s]; ++b) {
      if (next_block && b + 1 < n[s]) {
        const int64_t nb = t[s * width + b + 1];
        for (int64_t o = 0; o < bytes; o += 64) {
          __builtin_prefetch(kp + nb * stride + o);
          __builtin_prefetch(vp + nb * stride + o);
        }
      }
      for (const char* base : {kp + t[s * width + b] * stride, vp + t[s * width + b] * stride})
        for (int64_t o = 0; o + 32 <= bytes; o += 32) {
          v8 x;
          std::memcpy(&x, base + o, sizeof(x));
          acc += x;
        }
    }
    total += acc[0];
  }
  return total;
}
TORCH_LIBRARY(everystop_kv_read, m) {
  m.def("read_blocks(Tensor k, Tensor v, Tensor tables, Tensor num_blocks, bool next_block)"
        " -> float");
}
TORCH_LIBRARY_IMPL(everystop_kv_read, CPU, m) { m.impl("read_blocks", &read_blocks); }
"""


def _load_reader() -> Any:
    import torch
    from torch.utils.cpp_extension import load_inline

    load_inline(name="everystop_kv_read", cpp_sources=[_READER_SOURCE],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                is_python_module=False, verbose=False)
    return torch.ops.everystop_kv_read.read_blocks


def _contiguous_tables(num_blocks: Any) -> Any:
    """Block tables giving each sequence adjacent blocks, in the same pool size."""
    import torch

    tables = torch.zeros((len(num_blocks), int(num_blocks.max())), dtype=torch.long)
    start = 0
    for i, n in enumerate(num_blocks.tolist()):
        tables[i, :n] = torch.arange(start, start + n)
        start += n
    return tables


def measure_block_size(block: int, rounds: int, kernels: dict[str, Any], reader: Any,
                       seqs: list[tuple[int, int]]) -> dict[str, Any]:
    import torch

    from everystop.executor.layers.attention import paged_attention

    q, layers, meta, kv_bytes = ak.build(seqs, torch.bfloat16, block_size=block)
    num_blocks = torch.tensor([(n + block - 1) // block for n in meta.seq_lens_list])
    read_bytes = ak.LAYERS * 2 * int(num_blocks.sum()) * layers[0][0][0].numel() * 2
    adjacent = _contiguous_tables(num_blocks)
    reference = torch.empty(read_bytes // 4).normal_()

    def sequential() -> None:
        reference.sum()

    def paged() -> None:
        for kc, vc in layers:
            reader(kc, vc, meta.block_tables, num_blocks, True)

    def contiguous() -> None:
        for kc, vc in layers:
            reader(kc, vc, adjacent, num_blocks, True)

    adjacent_meta = dataclasses.replace(meta, block_tables=adjacent)

    def kernel(k: Any, m: Any) -> Any:
        return lambda: [paged_attention(q, kc, vc, m, ak.HEAD_DIM ** -0.5, kernels=k,
                                        backend="kernel") for kc, vc in layers]

    readers = {"paged_read": (paged, read_bytes), "contiguous_read": (contiguous, read_bytes)}
    for name, k in kernels.items():
        readers[name] = (kernel(k, meta), kv_bytes)
    best_isa = next(iter(kernels))  # best first
    readers[f"{best_isa}-contiguous"] = (kernel(kernels[best_isa], adjacent_meta), kv_bytes)
    for fn, _ in readers.values():  # warm-up
        fn()
    shares: dict[str, list[float]] = {name: [] for name in readers}
    sequential_gb_s = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sequential()
        seq_gb_s = read_bytes / (time.perf_counter() - t0) / 1e9
        sequential_gb_s.append(seq_gb_s)
        for name, (fn, nbytes) in readers.items():
            t0 = time.perf_counter()
            fn()
            shares[name].append(nbytes / (time.perf_counter() - t0) / 1e9 / seq_gb_s)
    return {
        "block_size": block, "kv_bytes": kv_bytes, "bytes_read_with_block_padding": read_bytes,
        "sequential_read_gb_s_median": statistics.median(sequential_gb_s),
        "share_of_sequential_read_median": {k: statistics.median(v) for k, v in shares.items()},
        "share_of_sequential_read_range": {k: [min(v), max(v)] for k, v in shares.items()},
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--block-sizes", default="16,32,64,128")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sequences", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    ap.add_argument("--out", default="benchmarks/results/kv_read_ceiling.json")


def run(args: argparse.Namespace) -> int:
    import torch

    from everystop.executor.layers.cpu_kernels import load_cpu_kernels, runnable_isas

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    reader = _load_reader()
    kernels = {f"kernel-{isa}": load_cpu_kernels(isa) for isa in runnable_isas()
               if isa != "generic"}
    rng = random.Random(1)
    seqs = [(rng.randint(250, 350), 1) for _ in range(args.sequences)]
    results = [measure_block_size(int(b), args.rounds, kernels, reader, seqs)
               for b in args.block_sizes.split(",")]
    report = {
        "scenario": f"decode {args.sequences} x 250-350 tokens, bf16 K/V, {ak.HEADS} heads / "
                    f"{ak.KV_HEADS} kv heads / head_dim {ak.HEAD_DIM}, {ak.LAYERS} layers, "
                    f"blocks scattered in a {ak.SPREAD}x pool",
        "threads": threads, "rounds": args.rounds, "timing": "median of per-round ratios",
        "results": results,
    }
    write_result(report, args.out)
    return 0

