"""Paged attention speed: the pure-torch fallback vs every CPU kernel build this machine runs
(AVX-512 with BF16, AVX-512, AVX2, generic), for fp32, bf16 and fp16 KV caches.

Scenarios (SmolLM2-135M attention shape: 9 heads, 3 kv heads, head_dim 64, block 16):
  decode: 128 single-token sequences with 250-350 tokens of context
  mixed:  127 such decodes + one 512-token prefill chunk over a 256-token cached prefix
Each timed call runs LAYERS layers, each with its own pool whose blocks are scattered through
a pool 4x larger than the sequences need, as after a while of serving, so the K/V stream from
memory, not from the last-level cache. Effective bandwidth = bytes of K/V the step must read /
time, reported beside the read bandwidth measured in the same run.

    everystop bench attention [--threads N] [--repeats R]

Writes benchmarks/results/attention_bench.json and prints it.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from everystop.results import write_result

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, SPREAD = 9, 3, 64, 16, 8, 4


def build(seqs: list[tuple[int, int]], dtype: Any, seed: int = 0,
          block_size: int = BLOCK) -> tuple[Any, ...]:
    import torch

    from everystop.executor.layers.attention import AttentionMetadata

    rng = random.Random(seed)
    need = [(n + block_size - 1) // block_size for n, _ in seqs]
    pool_blocks = SPREAD * sum(need)
    ids = rng.sample(range(pool_blocks), sum(need))  # scattered through a larger pool
    tables = torch.zeros((len(seqs), max(need)), dtype=torch.long)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    shape = (pool_blocks, block_size, KV_HEADS, HEAD_DIM)
    layers = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
              for _ in range(LAYERS)]
    qsl = [0]
    for _, ql in seqs:
        qsl.append(qsl[-1] + ql)
    q = torch.randn((qsl[-1], HEADS, HEAD_DIM))
    lens = [n for n, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long),
        query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor(lens), block_tables=tables,
        block_size=block_size, max_query_len=max(ql for _, ql in seqs), max_seq_len=max(lens),
        query_start_loc_list=qsl, seq_lens_list=lens)
    # K/V bytes a step must read at least once: every context token, K and V, all kv heads,
    # every layer.
    kv_bytes = LAYERS * 2 * sum(lens) * KV_HEADS * HEAD_DIM * layers[0][0].element_size()
    return q, layers, meta, kv_bytes


def time_impls(impls: dict[str, dict[str, Any]], q: Any, layers: list[tuple[Any, Any]],
               meta: Any, repeats: int) -> dict[str, float]:
    """Min seconds per implementation for all layers. Rounds interleave the implementations,
    and the min is kept, because the machine is shared and interference only adds time."""
    from everystop.executor.layers.attention import paged_attention

    def call(opts: dict[str, Any]) -> None:
        for kc, vc in layers:
            paged_attention(q, kc, vc, meta, HEAD_DIM ** -0.5, **opts)

    best = {}
    for name, opts in impls.items():
        call(opts)  # warm-up (and the kernel build on first use)
        best[name] = float("inf")
    for _ in range(repeats):
        for name, opts in impls.items():
            t0 = time.perf_counter()
            call(opts)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/attention_bench.json")


def run(args: argparse.Namespace) -> int:
    import torch

    from everystop.bench.roofline import read_bandwidth_gb_s
    from everystop.executor.layers.cpu_kernels import load_cpu_kernels, runnable_isas

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)

    impls: dict[str, dict[str, Any]] = {"torch": {"backend": "torch"}}
    for isa in runnable_isas():
        impls[f"kernel-{isa}"] = {"kernels": load_cpu_kernels(isa), "backend": "kernel"}
    read_gb_s = read_bandwidth_gb_s()
    rng = random.Random(1)
    decodes = [(rng.randint(250, 350), 1) for _ in range(128)]
    scenarios = {"decode_128x300": decodes, "mixed_127dec_512prefill": decodes[:127] + [(768, 512)]}
    results = []
    for name, seqs in scenarios.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            q, layers, meta, kv_bytes = build(seqs, dtype)
            sec = time_impls(impls, q, layers, meta, args.repeats)
            gb_s = {k: kv_bytes / v / 1e9 for k, v in sec.items()}
            results.append({
                "scenario": name, "kv_dtype": str(dtype).removeprefix("torch."),
                "layers": LAYERS, "num_tokens": q.shape[0], "kv_bytes": kv_bytes,
                "seconds": sec, "effective_gb_per_s": gb_s,
                "share_of_read_bandwidth": {k: v / read_gb_s for k, v in gb_s.items()}})
    report = {
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
        "threads": threads, "torch": torch.__version__,
        "read_bandwidth_gb_s": read_gb_s, "timing": "min over repeats", "results": results,
    }
    write_result(report, args.out)
    return 0
