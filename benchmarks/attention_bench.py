"""Paged attention speed: the reference vs the pure-torch fallback vs the C++ CPU kernel.

Scenarios (SmolLM2-135M attention shape: 9 heads, 3 kv heads, head_dim 64, block 16):
  decode: 128 single-token sequences with ~300 tokens of context
  mixed:  127 such decodes + one 512-token prefill chunk over a 256-token cached prefix
for fp32 and bf16 caches. Effective bandwidth = bytes of K/V the step must read / time.

    PYTHONPATH=src python benchmarks/attention_bench.py [--threads N] [--repeats R]

Writes benchmarks/results/attention_bench.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from everystop.executor.layers import attention_cpu
from everystop.executor.layers.attention import BACKEND_ENV, AttentionMetadata, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def build(seqs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    rng = random.Random(seed)
    need = [(n + BLOCK - 1) // BLOCK for n, _ in seqs]
    ids = list(range(sum(need)))
    rng.shuffle(ids)  # scattered blocks, as after a while of serving
    tables = torch.zeros((len(seqs), max(need)), dtype=torch.long)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    shape = (sum(need), BLOCK, KV_HEADS, HEAD_DIM)
    kc, vc = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    qsl = [0]
    for _, ql in seqs:
        qsl.append(qsl[-1] + ql)
    q = torch.randn((qsl[-1], HEADS, HEAD_DIM)).to(dtype)
    lens = [n for n, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long),
        query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor(lens), block_tables=tables,
        block_size=BLOCK, max_query_len=max(ql for _, ql in seqs), max_seq_len=max(lens),
        query_start_loc_list=qsl, seq_lens_list=lens)
    # K/V bytes a step must read at least once: every context token, K and V, all kv heads.
    kv_bytes = 2 * sum(lens) * KV_HEADS * HEAD_DIM * kc.element_size()
    return q, kc, vc, meta, kv_bytes


def time_impls(impls: tuple[str, ...], args, repeats: int) -> dict[str, float]:
    """Min seconds per implementation. Rounds interleave the implementations, and the min is
    kept, because the machine is shared and interference only ever adds time."""
    best = {}
    for impl in impls:
        os.environ[BACKEND_ENV] = impl
        paged_attention(*args)  # warm-up (and the kernel build on first use)
        best[impl] = float("inf")
    for _ in range(repeats):
        for impl in impls:
            os.environ[BACKEND_ENV] = impl
            t0 = time.perf_counter()
            paged_attention(*args)
            best[impl] = min(best[impl], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results/attention_bench.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    ok = attention_cpu.kernel_available()
    load_s = time.perf_counter() - t0

    rng = random.Random(1)
    decodes = [(rng.randint(250, 350), 1) for _ in range(128)]
    scenarios = {"decode_128x300": decodes, "mixed_127dec_512prefill": decodes[:127] + [(768, 512)]}
    results = []
    for name, seqs in scenarios.items():
        for dtype in (torch.float32, torch.bfloat16):
            q, kc, vc, meta, kv_bytes = build(seqs, dtype)
            call = (q, kc, vc, meta, HEAD_DIM ** -0.5)
            row = {"scenario": name, "dtype": str(dtype).removeprefix("torch."),
                   "num_tokens": q.shape[0], "kv_bytes": kv_bytes, "seconds": {}}
            impls = ("reference", "torch") + (("cpp",) if ok else ())
            row["seconds"] = time_impls(impls, call, args.repeats)
            sec = row["seconds"]
            row["speedup_vs_reference"] = {k: sec["reference"] / v for k, v in sec.items()}
            if ok:
                row["cpp_speedup_vs_torch"] = sec["torch"] / sec["cpp"]
            row["effective_gb_per_s"] = {k: kv_bytes / v / 1e9 for k, v in sec.items()}
            results.append(row)
    os.environ.pop(BACKEND_ENV, None)
    report = {
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
        "threads": args.threads, "torch": torch.__version__, "machine": platform.processor()
        or platform.machine(), "cpu_count": os.cpu_count(), "kernel_available": ok,
        "kernel_load_seconds": load_s,  # includes the build when the cache was cold
        "timing": "min over repeats", "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
