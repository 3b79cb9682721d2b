"""Memory and single-stream speed on the SAME GGUF files, everystop's server against
llama.cpp's, side by side in one run; writes JSON.

For each file, both servers are started (one slot / one sequence, a small context), and:
- RSS after load (/proc/<pid>/status VmRSS), minus the KV pool's bytes, per parameter;
- `--requests` requests one at a time (random prompt ids, greedy, ignore_eos), streamed,
  alternating between the two servers; TTFT = first token - request sent (the prefill of
  `--prompt-len` tokens), TPOT = (last token - first token) / (tokens - 1); p50 over
  requests, and the weight bytes read per token / TPOT as a share of the machine's read
  bandwidth.

    everystop bench quant-vs-llamacpp --llama-server /path/to/llama-server \\
        --gguf /tmp/llama1b-q4_0.gguf --gguf /tmp/llama1b-q8_0.gguf --out results.json

llama.cpp is not built here: pass its binary (built outside this tree).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from contextlib import ExitStack
from typing import Any

from everystop.bench.client import sse_lines
from everystop.bench.roofline import read_bandwidth_gb_s
from everystop.bench.servers import everystop_server, llama_server, process_memory
from everystop.results import cpu_info, write_result
from everystop.stats import percentile


def gguf_facts(path: str) -> dict[str, Any]:
    """Parameters, tensor bytes, and the KV bytes per token (fp16 K and V) of a GGUF."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if k.startswith("llama.")}
    layers, heads = meta["llama.block_count"], meta["llama.attention.head_count"]
    kv = meta.get("llama.attention.head_count_kv", heads)
    head_dim = meta["llama.embedding_length"] // heads
    return {"params": sum(int(t.n_elements) for t in r.tensors),
            "tensor_bytes": sum(int(t.n_bytes) for t in r.tensors),
            "kv_bytes_per_token_fp16": 2 * layers * kv * head_dim * 2,
            # the token list's length (the first tensor's shape, read here before, was the
            # norm's width: 576, so prompts drew from the first 476 ids only)
            "vocab": len(r.fields["tokenizer.ggml.tokens"].data)}


def stream_one(port: int, prompt: list[int], n: int, llama: bool) -> list[float]:
    """Arrival times of the streamed chunks of one request."""
    import httpx

    if llama:
        url, body = f"http://127.0.0.1:{port}/completion", {
            "prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "cache_prompt": False}
    else:
        url, body = f"http://127.0.0.1:{port}/v1/completions", {
            "model": "default", "prompt": prompt, "max_tokens": n, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    times = []
    with httpx.stream("POST", url, json=body, timeout=None) as resp:
        resp.raise_for_status()
        pending = b""
        for chunk in resp.iter_bytes():
            lines, pending = sse_lines(pending, chunk)
            for line in lines:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    event = json.loads(line[6:])
                    if llama and event.get("stop") and not event.get("content"):
                        continue
                    times.append(time.perf_counter())
    return times


def measure_pair(args: argparse.Namespace, path: str, facts: dict[str, Any],
                 prompts: list[list[int]]) -> dict[str, dict[str, Any]]:
    """Both servers up at once (bench/servers.py's launchers), the requests alternating between
    them (A B, B A, ...), so both see the same minutes of this shared machine; an idle server
    costs the other nothing (llama.cpp waits on its socket, everystop's engine thread on an
    event)."""
    ctx = args.prompt_len + args.new_tokens + 64
    llama_flags = ["-np", "1", "-c", str(ctx), "-t", str(args.threads)]
    llama_kv = facts["kv_bytes_per_token_fp16"] * ctx  # its default f16 cache
    ours_kv = facts["kv_bytes_per_token_fp16"] * 16 * (-(-ctx // 16))
    # Absolute: everystop_server starts the server from the source tree's parent directory.
    ours_flags = ["--model", os.path.abspath(path), "--max-num-seqs", "1",
                  "--max-model-len", str(ctx),
                  "--kv-cache-memory", str(ours_kv), "--kv-cache-dtype", "float16",
                  "--served-model-name", "default", "--log-level", "warning",
                  "--quantization", args.quantization, "--threads", str(args.threads),
                  "--cpu-kernels", args.cpu_kernels,
                  *(["--int8-decode-dot"] if args.int8_decode_dot else [])]
    servers = []  # (engine, llama?, port, process, command, KV bytes, load seconds)
    with ExitStack() as stack:
        # One at a time: each load time is its own.
        t0 = time.perf_counter()
        llama = stack.enter_context(llama_server(args.llama_server, path, llama_flags,
                                                 timeout_s=600))
        servers.append(("llama.cpp", True, _port(llama.url), llama.proc, llama.command,
                        llama_kv, time.perf_counter() - t0))
        t0 = time.perf_counter()
        proc, url = stack.enter_context(everystop_server(
            ours_flags, failure=f"everystop did not start on {path}"))
        servers.append(("everystop", False, _port(url), proc,
                         [sys.executable, "-m", "everystop", "serve", "--host", "127.0.0.1",
                          "--port", str(_port(url)), *ours_flags],
                         ours_kv, time.perf_counter() - t0))
        rss = {}
        warm_up = [t + 1 for t in prompts[0]]  # not a measured prompt: no prefix-cache hit
        for engine, is_llama, port, proc, *_ in servers:
            stream_one(port, warm_up, 4, is_llama)
            rss[engine] = process_memory(proc.pid)["rss_bytes"]
        tpots: dict[str, list[float]] = {engine: [] for engine, *_ in servers}
        ttfts: dict[str, list[float]] = {engine: [] for engine, *_ in servers}
        for i, p in enumerate(prompts):
            for engine, is_llama, port, *_ in (servers if i % 2 == 0 else servers[::-1]):
                t0 = time.perf_counter()
                times = stream_one(port, p, args.new_tokens, is_llama)
                if times:
                    ttfts[engine].append(times[0] - t0)
                if len(times) > 1:
                    tpots[engine].append((times[-1] - times[0]) / (len(times) - 1))
        out = {}
        for engine, _, _, proc, command, kv_bytes, load_s in servers:
            p50 = percentile(tpots[engine], 50)
            out[engine] = {
                "engine": engine, "command": command, "load_s": round(load_s, 1),
                "rss_after_load_bytes": rss[engine],
                "rss_after_run_bytes": process_memory(proc.pid)["rss_bytes"],
                "kv_pool_bytes": kv_bytes,
                "rss_minus_kv_per_param": round((rss[engine] - kv_bytes) / facts["params"], 3),
                "tpot_p50_ms": round(p50 * 1e3, 2),
                "tpot_ms": [round(t * 1e3, 1) for t in tpots[engine]],
                "ttft_p50_ms": round(percentile(ttfts[engine], 50) * 1e3, 1),
                "ttft_ms": [round(t * 1e3, 1) for t in ttfts[engine]],
                "weight_read_gb_s": round(facts["tensor_bytes"] / p50 / 1e9, 2)}
        return out


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--gguf", action="append", required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--int8-decode-dot", action="store_true",
                    help="everystop's single-row decodes with integer dot products (as "
                    "llama.cpp's quantized GEMV)")
    ap.add_argument("--cpu-kernels", default="auto",
                    help="everystop's kernel build (avx2: the AVX2 reproduction on an AVX-512 "
                    "machine, beside a llama.cpp built for AVX2 only and ONEDNN_MAX_CPU_ISA=AVX2 "
                    "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 in the environment)")
    ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    bandwidth = read_bandwidth_gb_s()
    rng = random.Random(0)
    files = []
    for path in args.gguf:
        facts = gguf_facts(path)
        prompts = [[rng.randrange(100, min(facts["vocab"], 49152)) for _ in range(args.prompt_len)]
                   for _ in range(args.requests)]
        entry: dict[str, Any] = {"gguf": path, **facts, "load_before": os.getloadavg()}
        for engine, res in measure_pair(args, path, facts, prompts).items():
            res["of_read_bandwidth"] = round(res["weight_read_gb_s"] / bandwidth, 3)
            entry[engine] = res
            print(path, engine, {k: v for k, v in res.items()
                                 if k not in ("command", "tpot_ms", "ttft_ms")}, flush=True)
        e, ll = entry["everystop"], entry["llama.cpp"]
        entry["rss_per_param_ratio"] = round(e["rss_minus_kv_per_param"]
                                             / ll["rss_minus_kv_per_param"], 3)
        entry["tpot_p50_ratio"] = round(e["tpot_p50_ms"] / ll["tpot_p50_ms"], 3)
        entry["ttft_p50_ratio"] = round(e["ttft_p50_ms"] / ll["ttft_p50_ms"], 3)
        entry["load_after"] = os.getloadavg()
        files.append(entry)
    write_result({"benchmark": "quant_vs_llamacpp", "cpu": cpu_info(),
          "read_bandwidth_gb_s": round(bandwidth, 2), "requests": args.requests,
          "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
          "threads": args.threads, "files": files}, args.out)
    return 0
