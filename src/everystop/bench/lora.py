"""LoRA at speed: 32 concurrent streams spread over 8 random rank-16 adapters (q/k/v/o/gate/up/
down) against the same load on the base model, through one `everystop serve` of the default
model (issue 46: the adapters' load reaches at least 80% of the base load's output throughput).

The adapters are random PEFT directories written to a temporary directory (seeded). Both loads
are the same requests (same prompt token ids, `ignore_eos`, the same output lengths) from the
same client (bench/client.py); only the `model` each request names differs. The loads
alternate, --repeats times each, and the median output throughput of each is compared.

    everystop bench lora --out benchmarks/results/lora_throughput.json
    everystop bench lora --quick          # a smoke run: a few tokens per stream
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from everystop.bench import perf_page
from everystop.bench.client import ServeOptions, run_serve
from everystop.bench.servers import everystop_server
from everystop.results import write_result
from everystop.workload import Workload, WorkloadRequest

TARGET_RATIO = 0.8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=str(perf_page.RESULTS / "lora_throughput.json"))
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens each stream generates")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each load, alternating")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 8 tokens per stream, one run of each load")
    ap.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                    help="extra `everystop serve` flag (repeatable, e.g. --serve-flag=--dtype"
                    " --serve-flag=bfloat16)")
    ap.add_argument("--notes", default="", help="what to know about the machine or the run")


def projection_shapes(hidden: int, intermediate: int, q_size: int, kv_size: int
                      ) -> dict[str, tuple[int, int]]:
    """(out, in) of each PEFT target projection of a Llama-style base."""
    return {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden),
            "v_proj": (kv_size, hidden), "o_proj": (hidden, q_size),
            "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
            "down_proj": (hidden, intermediate)}


def write_random_adapter(directory: Path, num_layers: int,
                         shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> None:
    """A PEFT LoRA directory targeting every projection of every layer: A and B normal with a
    small deviation (so the deltas are real work, and the model's output stays finite)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for proj in TARGETS:
            out_size, in_size = shapes[proj]
            module = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_size, generator=gen) / 32
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_size, rank, generator=gen) / 32
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(TARGETS), "task_type": "CAUSAL_LM"}
    (directory / "adapter_config.json").write_text(json.dumps(config))


def default_model_adapters(root: Path, count: int, rank: int) -> list[tuple[str, str]]:
    """`count` random adapters of the default model under `root`: [(name, path)]."""
    from everystop.executor.models.loader import _open_gguf, default_model_path

    args = _open_gguf(default_model_path())[1]
    shapes = projection_shapes(args.hidden_size, args.intermediate_size,
                               args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim)
    adapters = []
    for i in range(count):
        write_random_adapter(root / f"lora{i}", args.num_layers, shapes, rank, seed=i)
        adapters.append((f"lora{i}", str(root / f"lora{i}")))
    return adapters


def stream_workload(streams: int, prompt_len: int, max_tokens: int, num_adapters: int,
                    seed: int = 0) -> tuple[Workload, dict[str, list[int]]]:
    """`streams` requests of random prompt token ids, request i in tenant `lora{i % n}`."""
    gen = torch.Generator().manual_seed(seed)
    requests, ids = [], {}
    for i in range(streams):
        rid = f"s{i}"
        ids[rid] = torch.randint(100, 10_000, (prompt_len,), generator=gen).tolist()
        requests.append(WorkloadRequest(rid, prompt_len=prompt_len, max_tokens=max_tokens,
                                        tenant=f"lora{i % num_adapters}"))
    return Workload("lora_streams", seed, {"streams": streams}, requests), ids


def _load(url: str, workload: Workload, ids: dict[str, list[int]],
          model_by_tenant: dict[str, str]) -> dict[str, Any]:
    opts = ServeOptions(base_url=url, max_concurrency=len(workload.requests), progress=False,
                        prompt_token_ids=ids, model_by_tenant=model_by_tenant)
    summary = asyncio.run(run_serve(workload, opts))["summary"]
    keep = ("completed", "failed", "duration_s", "output_tokens", "output_throughput")
    return {**{k: summary[k] for k in keep}, "tpot_ms_p50": summary["tpot_ms"]["p50"],
            "ttft_ms_p50": summary["ttft_ms"]["p50"]}


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.max_tokens, args.repeats = 8, 1
    with tempfile.TemporaryDirectory(prefix="everystop-lora-") as tmp:
        adapters = default_model_adapters(Path(tmp), args.adapters, args.rank)
        flags = [f for name, path in adapters for f in ("--lora", f"{name}={path}")]
        flags += ["--max-num-seqs", str(max(args.streams, 1)), "--log-level", "warning",
                  *args.serve_flag]
        workload, ids = stream_workload(args.streams, args.prompt_len, args.max_tokens,
                                        args.adapters)
        on_adapters = {name: name for name, _ in adapters}
        runs: dict[str, list[dict[str, Any]]] = {"base": [], "lora": []}
        with everystop_server(flags, failure="everystop serve did not come up") as (_, url):
            warm = stream_workload(args.streams, args.prompt_len, 2, args.adapters, seed=1)
            _load(url, *warm, {})  # warm-up: the kernels' first calls, the decode shapes
            _load(url, *warm, on_adapters)
            for _ in range(args.repeats):
                runs["base"].append(_load(url, workload, ids, {}))
                runs["lora"].append(_load(url, workload, ids, on_adapters))
                print(json.dumps({k: v[-1] for k, v in runs.items()}), flush=True)
    median = {k: statistics.median(r["output_throughput"] for r in v) for k, v in runs.items()}
    ratio = median["lora"] / median["base"] if median["base"] else math.nan
    failed = sum(r.get("failed", 0) for v in runs.values() for r in v)
    write_result({
        "target": {"lora_over_base_output_throughput_at_least": TARGET_RATIO},
        "quick": args.quick, "adapters": args.adapters, "rank": args.rank,
        "targets": list(TARGETS), "streams": args.streams, "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens, "repeats": args.repeats,
        "serve_command": ["everystop", "serve", *_shown(flags)],
        "median_output_tok_s": median, "lora_over_base": ratio,
        "pass": failed == 0 and ratio >= TARGET_RATIO, "failed_requests": failed,
        "runs": runs, "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "python": sys.executable,
        "notes": args.notes,
    }, args.out)
    return 0 if failed == 0 else 1


def _shown(flags: list[str]) -> list[str]:
    """The serve flags with each adapter's temporary path replaced by how it was made
    (write_random_adapter, the seed its name's number)."""
    shown = []
    for flag in flags:
        name, sep, _ = flag.partition("=")
        shown.append(f"{name}=<random adapter, seed {name.removeprefix('lora')}>"
                     if sep and name.startswith("lora") else flag)
    return shown
