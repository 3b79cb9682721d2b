"""Engine command-line flags, shared by `everystop serve`, `generate` and `bench`.

`add_engine_args(parser)` adds the flags; `engine_config_from_args(args)` turns them into a
validated EngineConfig. Flags left unset fall back to the config dataclasses' defaults, so the
defaults live in one place (config.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from everystop.config import (
    ATTENTION_BACKENDS,
    CPU_KERNEL_CHOICES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    ConfigError,
    EngineConfig,
    TpotTarget,
)
from everystop.config import parse_tpot_target as config_parse_tpot_target

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1073741824' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB, 512MiB, 1e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _tier_caps(text: str) -> tuple[int, int, int]:
    """'8' -> (8, 8, 8); '16,8,4' -> per tier 0, 1, 2."""
    try:
        parts = [int(p) for p in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N0,N1,N2, got {text!r}") from None
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected N or N0,N1,N2, got {text!r}")
    return (parts[0], parts[1], parts[2])




def _ttft_target(text: str) -> float | str:
    """--ttft-target-ms: a number of ms, 'auto', or 'off' (0)."""
    if text.lower() in ("auto", "off"):
        return "auto" if text.lower() == "auto" else 0.0
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not ms >= 0:
        raise argparse.ArgumentTypeError(f"expected MS >= 0, auto or off, got {text!r}")
    return ms


def parse_tpot_target(text: str) -> TpotTarget:
    """--tpot-target-ms (see config.parse_tpot_target), with argparse's error on a bad value."""
    try:
        return config_parse_tpot_target(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine's flags (all default to None: unset means the config default)."""
    g = parser.add_argument_group("engine")
    _add_model_args(g)
    _add_scheduler_args(g)
    _add_cache_args(g)
    return parser


def _add_model_args(g: argparse._ArgumentGroup) -> None:
    """The model, its numbers and the kernels that compute it."""
    g.add_argument("--model", default=None,
                   help="GGUF file, or a directory of safetensors (default: SmolLM2-135M GGUF)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path if not next to the model")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help="activations (default auto: bf16 where the CPU multiplies bf16 natively "
                   "and the weights are not quantized blocks, else float32; bf16 on a GPU; "
                   "the choice and its reason are logged at start-up)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ...")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--threads", dest="num_threads", type=int, default=None,
                   help="CPU compute threads (default: the cores this process may use)")
    g.add_argument("--cpu-kernels", choices=CPU_KERNEL_CHOICES, default=None,
                   help="CPU kernel build: auto (the best this CPU runs), an ISA, or off")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None)
    g.add_argument("--cpu-16bit-gemm", choices=["auto", "fp32", "native"], default=None,
                   help="16-bit weights on CPU: prefill GEMMs in fp32 or native (default auto: "
                   "the faster here, timed at start-up); block weights: native multiplies "
                   "them in bf16 tiles (~1.7x faster with AVX512-BF16; auto keeps fp32)")
    g.add_argument("--no-decoder-stack", dest="decoder_stack", action="store_false",
                   default=None, help="run decode steps layer by layer from Python instead of "
                   "in one kernel call (for A/B measurement)")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="weights in memory: auto (as the file holds them: GGUF Q8_0/Q4_0/Q4_1 "
                   "blocks as they are, K-quants requantized to the nearest), none (all "
                   "converted to --dtype), bf16/f16 (held 16-bit next to --dtype activations: with "
                   "--dtype float32 the fastest like-for-like with an F16 GGUF on AVX2 CPUs), or "
                   "q8_0/q4_0 (float weights quantized at load)")
    g.add_argument("--int8-decode-dot", choices=["auto", "on", "off"], nargs="?", const="on",
                   default=None, help="block weights (Q8_0/Q4_0/Q4_1) meet activations rounded "
                   "to int8 per 32 values, as llama.cpp: integer dot products (~1.4x faster "
                   "decode GEMV; logits move ~10x less than from the weights' own quantization), "
                   "with the kernels batch-invariant so that chunk boundaries and prefix-cache "
                   "hits cannot change an output. Default auto: on for block weights on the CPU "
                   "kernels with an integer dot, off for float weights; off: fp32 activations")
    g.add_argument("--batch-invariant", action="store_true", default=None,
                   help="a request's tokens do not depend on what else is in the pass (batch "
                   "size, prompt chunks, preemption): every linear on the GEMV kernels, "
                   "attention one query token at a time. CPU kernels only; a 512-token prefill "
                   "takes ~1.4x as long, decode about the same")
    g.add_argument("--onednn-cache-capacity", type=int, default=None, metavar="N",
                   help="compiled oneDNN GEMMs kept per cache, one per batch shape, ~0.4 MiB "
                   "each (default 64, or ONEDNN_PRIMITIVE_CACHE_CAPACITY / LRU_CACHE_CAPACITY "
                   "if set): larger recompiles less often and holds more memory")
    g.add_argument("--lora", dest="lora_modules", type=_lora_module, action="append",
                   default=None, metavar="NAME=PATH",
                   help="serve a LoRA adapter (a PEFT directory or a llama.cpp GGUF adapter "
                   "file) under NAME beside the base model: a request picks it by its `model` "
                   "field (repeatable)")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="load and unload LoRA adapters while serving (POST "
                   "/v1/load_lora_adapter and /v1/unload_lora_adapter, operator routes)")
    g.add_argument("--max-loras", type=int, default=None,
                   help="most LoRA adapters the running requests may use at once; requests for "
                   "others wait their turn in queue order (default 0: no cap)")
    g.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="most LoRA adapters whose weights are held in memory; beyond N the "
                   "least recently used one no running request uses is dropped and read again "
                   "from its path on its next use (default 0: no cap; at least --max-loras)")
    g.add_argument("--max-lora-rank", type=int, default=None,
                   help="largest LoRA rank an adapter may have (default 64)")


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def _add_scheduler_args(g: argparse._ArgumentGroup) -> None:
    """What one forward pass may hold, and who goes first."""
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="most sequences in one forward pass")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one forward pass")
    g.add_argument("--chunk-size", type=int, default=None,
                   help="largest prefill chunk per sequence per step")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   default=None)
    g.add_argument("--scheduling", choices=["continuous", "static"], default=None)
    g.add_argument("--max-batch-size", type=int, default=None, help="static batching: batch size")
    g.add_argument("--no-static-padding", dest="static_padding", action="store_false",
                   default=None, help="static batching: drop finished members from the pass "
                   "instead of computing them until the batch drains")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's context length, capped "
                   "by what the KV pool holds for one sequence; logged at start-up)")
    g.add_argument("--preemption-mode", choices=["auto", "recompute", "swap"], default=None)
    g.add_argument("--aging-interval", dest="aging_interval_s", type=float, default=None,
                   help="seconds after which a waiting request moves up one priority tier")
    g.add_argument("--max-queued-per-tenant", type=int, default=None, help="0 = no cap")
    g.add_argument("--max-queued-per-tier", type=_tier_caps, default=None,
                   help="N or N0,N1,N2 (tiers 0, 1, 2); 0 = no cap")
    g.add_argument("--tpot-target-ms", dest="tpot_target", type=parse_tpot_target,
                   default=None, metavar="MS|off|TIER:MS,...",
                   help="step-time target: prefill gets what keeps a step within it "
                   "(default: derived from this machine at start-up; off: the fixed token "
                   "budget)")
    g.add_argument("--ttft-target-ms", dest="ttft_target", type=_ttft_target, default=None,
                   metavar="MS|auto|off", help="TTFT aging: a prompt later than half of this "
                   "may stretch its step's TPOT target (auto: per step, the larger of the TPOT "
                   "target and what a full chunk costs alone; default off)")
    g.add_argument("--tpot-max-stretch", dest="tpot_max_stretch", type=float, default=None,
                   help="the most a TTFT-aged step may stretch its TPOT target (default 4; "
                   "1: never)")
    g.add_argument("--speculative", default=None, metavar="off|ngram|draft:PATH",
                   help="speculative decoding: ngram proposes each decoding sequence's next "
                   "tokens by prompt lookup, draft:PATH by a smaller model with the same "
                   "tokenizer (GGUF file or HF directory), and one pass verifies them "
                   "(default off); the output is what plain decoding gives, greedy or "
                   "sampled, structured output included. Requests with disable_spec_decode "
                   "decode one token per pass")
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="most tokens proposed per sequence per pass (default 4, at most 32); "
                   "each pass sizes each sequence's k up to this by its acceptance and the "
                   "step-cost model, 0 where plain decoding is faster")
    g.add_argument("--ngram-min", type=int, default=None,
                   help="shortest trailing n-gram the ngram proposer matches (default 1)")
    g.add_argument("--ngram-max", type=int, default=None,
                   help="longest trailing n-gram the ngram proposer matches, tried first "
                   "(default 4, at most 16)")


def _add_cache_args(g: argparse._ArgumentGroup) -> None:
    """The KV pool (size, element type, prefix caching, swap) and the tensor-parallel shards."""
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="CPU KV pool size, e.g. 2GiB (default: sized from available memory)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="KV pool element type (auto: 16-bit where the CPU kernels run)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--num-gpu-blocks", dest="num_gpu_blocks_override", type=int, default=None,
                   help="exactly this many KV blocks (overrides the memory flags)")
    g.add_argument("--watermark", type=float, default=None,
                   help="fraction of KV blocks new admissions may not use")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=None)
    g.add_argument("--swap-space", dest="swap_space_gib", type=float, default=None,
                   help="host swap space in GiB")
    g.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="shards (worker processes; one GPU each on CUDA, gloo on CPU)")
    g.add_argument("--grammar-compile-timeout", dest="grammar_compile_timeout_s", type=float,
                   default=None, help="seconds a structured-output grammar may take to compile "
                   "before the request is refused (default 10)")


# Flag destinations that are engine options (EngineConfig.from_options keys).
ENGINE_OPTIONS = (
    "model", "tokenizer", "dtype", "device", "seed", "num_threads", "cpu_kernels",
    "attention_backend", "cpu_16bit_gemm", "decoder_stack", "int8_decode_dot", "batch_invariant",
    "kv_cache_dtype",
    "max_num_seqs",
    "max_num_batched_tokens", "chunk_size", "enable_chunked_prefill", "scheduling",
    "max_batch_size", "static_padding", "max_model_len",
    "preemption_mode", "aging_interval_s", "max_queued_per_tenant", "max_queued_per_tier",
    "tpot_max_stretch", "speculative", "num_speculative_tokens", "ngram_min", "ngram_max",
    "block_size", "kv_cache_memory", "gpu_memory_utilization", "num_gpu_blocks_override",
    "watermark", "enable_prefix_caching", "swap_space_gib", "tensor_parallel_size",
    "quantization", "onednn_cache_capacity", "grammar_compile_timeout_s", "lora_modules",
    "max_lora_rank", "enable_lora", "max_loras", "max_cpu_loras")


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    options = {k: getattr(args, k) for k in ENGINE_OPTIONS if hasattr(args, k)}
    if options.get("lora_modules") is not None:  # appended as a list; the config is frozen
        options["lora_modules"] = tuple(options["lora_modules"])
    tpot: TpotTarget | None = getattr(args, "tpot_target", None)
    if tpot is not None:  # one flag, two config fields
        options["tpot_target_ms"], options["tpot_target_ms_per_tier"] = tpot
    ttft: float | str | None = getattr(args, "ttft_target", None)
    if ttft is not None:
        options["ttft_target_ms"] = ttft
    return options


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises ConfigError (one clear line) on inconsistent values."""
    return EngineConfig.from_options(**engine_options_from_args(args))


def config_or_exit(args: argparse.Namespace) -> EngineConfig:
    """For CLI handlers: a bad configuration prints one line and exits 2, never a traceback."""
    try:
        return engine_config_from_args(args)
    except (ConfigError, TypeError) as exc:
        print(f"everystop: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
