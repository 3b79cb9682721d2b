"""Small frozen configuration objects, one per component, validated at construction.

No disk access here: derived numbers (how many KV blocks fit) are computed by the executor and
passed to the cache manager as arguments.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

SchedulingMode = Literal["continuous", "static"]
PreemptionMode = Literal["auto", "recompute", "swap"]
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The CPU kernel builds (best first; executor/layers/cpu_kernels.ISAS), "auto" or "off".
CPU_KERNEL_CHOICES = ("auto", "off", "avx512bf16", "avx512", "avx2", "generic")
ATTENTION_BACKENDS = ("auto", "kernel", "torch", "reference")
QUANTIZATIONS = ("auto", "none", "bf16", "f16", "q8_0", "q4_0")  # ModelConfig.quantization


# Where converted tokenizers and measured preemption costs are kept between runs.
CACHE_ENV = "EVERYSTOP_CACHE_DIR"


def cache_dir() -> str:
    """$EVERYSTOP_CACHE_DIR, else ~/.cache/everystop (read when called: a test may set it)."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache",
                                                     "everystop")


def default_openmp_wait() -> None:
    """Set GOMP_SPINCOUNT=10000 unless the user chose how OpenMP threads wait.

    NOTE: how OpenMP worker threads wait between parallel regions decides decode speed on CPU:
    a decode step runs ~300 short regions. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a
    wake-up per region (quiet 2-core machine: single-stream bf16 decode 67 ms/token); spinning
    forever collapses when the cores are shared (a spinning thread holds the core its partner
    needs: 2,024 ms/token measured under heavy load). A short spin (GOMP_SPINCOUNT=10000, then
    sleep) gets the quiet-machine speed (22 ms/token) and, under heavy load, stays far from the
    spinning collapse (112 ms/token; passive 43). On an oversubscribed machine set
    OMP_WAIT_POLICY=PASSIVE. Read once, when torch loads its OpenMP
    runtime, so the package calls this on import, before anything imports torch; an explicit
    OMP_WAIT_POLICY or GOMP_SPINCOUNT (or torch imported first) wins."""
    if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent with another."""


# Bounds of the speculative-decoding options (SchedulerConfig): a pass verifies at most this many
# proposals per sequence, found by matching at most this many trailing tokens.
MAX_SPECULATIVE_TOKENS = 32
MAX_NGRAM = 16


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission limits and batching policy: what one forward pass may contain."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # Largest prefill chunk one sequence may get in one step.
    chunk_size: int = 512
    enable_chunked_prefill: bool = True
    scheduling: SchedulingMode = "continuous"
    # Static batching baseline: wait for this many requests (or the timeout), then run them
    # together until all finish.
    max_batch_size: int = 32
    static_batch_timeout_s: float = 0.5
    # Static batching as a padded batch tensor runs it (Hugging Face `generate`): a finished
    # member keeps its seat and its KV blocks, and is still computed, until the batch drains.
    # False: finished members drop out of the pass (a kinder baseline than the usual one).
    static_padding: bool = True
    # Longest prompt + output of one request. None: derived where the engine is built (the
    # model's context length, capped by the tokens the KV pool holds for one sequence; with no
    # model, the pool alone).
    max_model_len: int | None = None
    # Preemption: recompute, swap to host, or let the cost model choose per victim.
    preemption_mode: PreemptionMode = "auto"
    # Below this many computed tokens a victim is always recomputed (cheap, no host memory).
    recompute_threshold_tokens: int = 256
    # At most this many sequences may sit in host swap space at once.
    max_swapped_seqs: int = 64
    # Anti-thrashing: a sequence preempted this many times within the window is protected.
    max_preemptions_in_window: int = 3
    preemption_window_s: float = 30.0
    # Aging: a waiting request's effective priority drops by one tier every this many seconds.
    aging_interval_s: float = 5.0
    # Per-tenant and per-tier caps on queued (not yet running) requests; 0 = no cap.
    max_queued_per_tenant: int = 0
    max_queued_per_tier: tuple[int, int, int] = (0, 0, 0)
    # Step-time (TPOT) target in ms: each step's prefill budget is the most prefill that keeps
    # the predicted step time within the tightest target of the tiers decoding in it (see
    # core/step_budget.py). None: derived from the machine at start-up; 0: off (the fixed
    # max_num_batched_tokens budget alone).
    tpot_target_ms: float | None = None
    # Per tier (0 premium, 1 standard, 2 best-effort); None: that tier uses tpot_target_ms.
    tpot_target_ms_per_tier: tuple[float | None, float | None, float | None] = (None, None, None)
    # TTFT aging (core/step_budget.py rules 5 and 6): a prompt whose lateness (time waited plus
    # the least time its remaining prompt can take) passes half this target may stretch its
    # step's TPOT target, up to tpot_max_stretch times it at lateness = this target. "auto":
    # derived per step from the live step-cost fit; 0 (the default): off, steps keep within
    # the TPOT target alone.
    ttft_target_ms: float | Literal["auto"] = 0.0
    # The most a TTFT-aged step may stretch its TPOT target (1 = never): every step, and so
    # every TPOT, stays within this multiple of the target (short of the rule-4 floor).
    tpot_max_stretch: float = 4.0
    # Speculative decoding (core/speculation.py): "ngram" proposes up to
    # num_speculative_tokens tokens per decoding sequence by prompt lookup (the last
    # ngram_max .. ngram_min tokens found earlier in its tokens), "draft:PATH" by a smaller
    # model with the target's tokenizer decoding greedily (executor/draft_proposer.py), and
    # one pass verifies them; each pass sizes each sequence's k (0 .. the cap) by its
    # acceptance and the step-cost model (core/spec_sizing.py).
    # Lossless: greedy and sampled output are what plain decoding gives (sampled: the same
    # distribution; seeded: the same tokens); structured output's proposals are cut at their
    # grammar. NOTE: requests with disable_spec_decode decode one token per pass. Off in
    # static scheduling.
    speculative: str = "off"  # "off", "ngram" or "draft:PATH"
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    # Most LoRA adapters the running requests may use at once (0: no cap). A waiting request
    # for another adapter waits at the head of its queue, in its aging order, until one of
    # those adapters has no running request left.
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ConfigError(f"max_loras must be >= 0 (0: no cap), got {self.max_loras}")
        _positive(self, "max_num_seqs", "max_num_batched_tokens", "chunk_size", "max_batch_size",
                  "aging_interval_s", "max_preemptions_in_window")
        if self.max_model_len is not None:
            _positive(self, "max_model_len")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise a full running batch alone exceeds the budget and the tail of the running
            # queue silently gets no decode progress.
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})")
        if self.scheduling not in ("continuous", "static"):
            raise ConfigError(
                f"scheduling must be 'continuous' or 'static', not {self.scheduling!r}")
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ConfigError(f"preemption_mode must be auto, recompute or swap, "
                              f"not {self.preemption_mode!r}")
        if self.static_batch_timeout_s < 0:
            raise ConfigError("static_batch_timeout_s must be >= 0")
        if len(self.max_queued_per_tier) != 3 or min(self.max_queued_per_tier) < 0:
            raise ConfigError("max_queued_per_tier takes three non-negative caps (tiers 0, 1, 2)")
        if self.max_queued_per_tenant < 0:
            raise ConfigError("max_queued_per_tenant must be >= 0")
        targets = self.tpot_target_ms_per_tier
        if len(targets) != 3 or any(t is not None and not t >= 0
                                    for t in (self.tpot_target_ms, *targets)):
            raise ConfigError("tpot_target_ms takes a number of ms >= 0 (0 = off) or None, "
                              "tpot_target_ms_per_tier three of them (tiers 0, 1, 2)")
        if self.ttft_target_ms != "auto" and not (
                isinstance(self.ttft_target_ms, (int, float)) and self.ttft_target_ms >= 0):
            raise ConfigError("ttft_target_ms takes a number of ms >= 0 (0 = off) or 'auto'")
        if not self.tpot_max_stretch >= 1:
            raise ConfigError(f"tpot_max_stretch must be >= 1, got {self.tpot_max_stretch!r}")
        self._check_speculative()

    def _check_speculative(self) -> None:
        if not isinstance(self.speculative, str) or not (
                self.speculative in ("off", "ngram") or draft_model_path(self.speculative)):
            raise ConfigError(f"speculative must be 'off', 'ngram' or 'draft:PATH', "
                              f"not {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be 1 .. {MAX_SPECULATIVE_TOKENS}, "
                              f"got {self.num_speculative_tokens!r}")
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise ConfigError(f"ngram_min and ngram_max need 1 <= ngram_min <= ngram_max <= "
                              f"{MAX_NGRAM}, got {self.ngram_min!r} and {self.ngram_max!r}")

    def replace(self, **changes: object) -> SchedulerConfig:
        """A validated copy with some fields changed (hot reload goes through here)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry, pool size policy, prefix caching, swap space."""

    block_size: int = 16
    # Fraction of the pool kept free for running sequences to grow into: new admissions may not
    # dip into it, so a preemption can always complete.
    watermark: float = 0.02
    enable_prefix_caching: bool = True
    # CUDA: the KV pool is what is left of this fraction of device memory after weights and
    # peak activations. CPU: the pool is kv_cache_memory bytes; None = sized from the machine
    # (a fraction of the memory available at start-up, capped; see ModelRunner).
    gpu_memory_utilization: float = 0.90
    kv_cache_memory: int | None = None
    # Element type of the KV pool. "auto": 16-bit where the CPU kernels run (attention streams
    # half the bytes and a pool holds twice the tokens), else the model's dtype.
    kv_cache_dtype: str = "auto"
    # Overrides both when set (tests, simulator): exactly this many device blocks.
    num_gpu_blocks_override: int | None = None
    swap_space_gib: float = 1.0

    def __post_init__(self) -> None:
        _positive(self, "block_size")
        if not 0.0 <= self.watermark < 0.5:
            raise ConfigError("watermark must be in [0, 0.5)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory must be > 0 bytes")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                              f"not {self.kv_cache_dtype!r}")
        if self.swap_space_gib < 0:
            raise ConfigError("swap_space_gib must be >= 0")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ConfigError("num_gpu_blocks_override must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run, in which dtype, on which device."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    tokenizer: str | None = None
    # Activation dtype; "auto" is chosen by the executor from the device, the CPU's flags and
    # the weight file (executor/dtype_choice.py): bf16 on CPUs with native bf16 dot products
    # for float weights, else fp32; bf16 (or fp16) on a GPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    seed: int = 0
    # CPU compute threads (torch intra-op); None = the cores this process may run on.
    num_threads: int | None = None
    # Which CPU kernel build the layers call (CPU_KERNEL_CHOICES); "auto" = the best this CPU
    # runs, "off" = plain torch everywhere.
    cpu_kernels: str = "auto"
    attention_backend: str = "auto"  # ATTENTION_BACKENDS
    # 16-bit weights on CPU: multiply compute-bound inputs in fp32 ("fp32") or with the
    # library's 16-bit GEMM ("native"); "auto" times both at start-up and keeps the faster
    # (native bf16 is ~4x fp32 on a Zen 5, ~0.5x on CPUs whose bf16 GEMM is emulated).
    # Block weights: "native" multiplies them in bf16 tiles whatever the activation dtype,
    # "auto"/"fp32" in fp32 tiles (executor/block_gemm_choice.py says why).
    cpu_16bit_gemm: Literal["auto", "fp32", "native"] = "auto"
    # Decode-sized batches (<= 8 tokens; up to 32 where every linear keeps the GEMV that far:
    # block weights, 16-bit weights beside fp32 activations) run every decoder layer in one CPU
    # kernel call: the same kernels, bit-identical results, without ~2 ms of Python per step.
    # False: layer by layer (for A/B measurement).
    decoder_stack: bool = True
    # How weights are held (QUANTIZATIONS): "auto" as the file stores them (GGUF Q8_0/Q4_0/
    # Q4_1 blocks kept, K-quants requantized to the nearest of those, 16-bit kept 16-bit),
    # "none" every weight converted to `dtype`, "bf16"/"f16" every projection and embedding
    # held 16-bit next to `dtype` activations (float32 on CPUs without bf16 arithmetic: no
    # casts around each GEMM), "q8_0"/"q4_0" float weights quantized at load.
    quantization: str = "auto"
    # Block weights (Q8_0/Q4_0/Q4_1) meet activations rounded to int8 per 32 values, as
    # llama.cpp does, at every row count: the decode GEMVs take integer dot products (~1.4x
    # faster at one row) and a row computes the same alone as beside others. "auto": on where
    # the CPU kernels run on block weights with an integer dot path, off for float/16-bit
    # weights (executor/int8_choice.py). The rounding moves the default model's logits ~8x less
    # than rounding its weights again to Q4_0 does (tests/executor/test_int8_vs_transformers.py)
    # but is not continuous: a ~1e-6 difference upstream flips roundings and moves a logprob by
    # up to ~0.1. So wherever int8 activations are on, the kernels also run batch-invariant (see
    # batch_invariant): a prompt split at other chunk boundaries, a prefix-cache hit or a busier
    # pass computes the same bits (the 128-request workload lost ~3% to it). "off": fp32
    # activations, the reference tests/executor/test_llama_vs_transformers.py holds within 1e-3.
    int8_decode_dot: Literal["auto", "on", "off"] = "auto"
    # A sequence's tokens do not depend on what else is in the pass (batch size, prompt chunks
    # beside it, preemption and recompute): every linear on the CPU GEMV kernels at any row
    # count, attention with one query token per work item. Needs the CPU kernels. Off by
    # default for float weights, whose prefill passes would take longer; int8 activations turn
    # it on for block weights (int8_decode_dot).
    batch_invariant: bool = False
    # Entries in each of oneDNN's two caches of compiled GEMMs (one per batch shape, ~0.4 MiB
    # each; executor/onednn_caches.py). None: 64, or what ONEDNN_PRIMITIVE_CACHE_CAPACITY /
    # LRU_CACHE_CAPACITY say. The libraries' own default (1,024) grew a server by ~0.4 GiB.
    onednn_cache_capacity: int | None = None
    # LoRA adapters served beside the base, (name, PEFT directory or llama.cpp GGUF adapter)
    # each; a request picks one by its `model` field. Their rank may not exceed max_lora_rank.
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 64
    # Adapters may also be loaded and unloaded while serving (POST /v1/load_lora_adapter);
    # implied by lora_modules.
    enable_lora: bool = False
    # Most adapters whose weights are held in memory (0: no cap): beyond it the least recently
    # used adapter no running request uses is dropped, and read again from its path when used.
    # Running requests' adapters stay even above it (max_loras bounds how many those are).
    max_cpu_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < 0:
            raise ConfigError(f"max_cpu_loras must be >= 0 (0: no cap), got "
                              f"{self.max_cpu_loras}")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ConfigError(f"LoRA adapter names must be distinct: {names}")
        for name, allowed in (("cpu_kernels", CPU_KERNEL_CHOICES),
                              ("attention_backend", ATTENTION_BACKENDS),
                              ("cpu_16bit_gemm", ("auto", "fp32", "native")),
                              ("quantization", QUANTIZATIONS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, not "
                                  f"{getattr(self, name)!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.onednn_cache_capacity is not None and self.onednn_cache_capacity < 1:
            raise ConfigError("onednn_cache_capacity must be >= 1 (0 would compile every GEMM "
                              f"at every call), got {self.onednn_cache_capacity}")
        if self.int8_decode_dot not in ("auto", "on", "off"):
            raise ConfigError("int8_decode_dot must be auto, on or off, not "
                              f"{self.int8_decode_dot!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError("dtype must be auto, float32, bfloat16 or float16, not "
                              f"{self.dtype!r}")
        if self.batch_invariant:
            self._check_batch_invariant()

    def _check_batch_invariant(self) -> None:
        """batch_invariant is refused by name where it could not hold."""
        if not self.device.startswith("cpu") or self.cpu_kernels == "off":
            raise ConfigError("batch_invariant needs the CPU kernels (device cpu, cpu_kernels "
                              f"not 'off'); got device {self.device!r}, cpu_kernels "
                              f"{self.cpu_kernels!r}")
        if self.attention_backend in ("torch", "reference"):
            raise ConfigError("batch_invariant needs the kernel attention backend, not "
                              f"{self.attention_backend!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: one process (one GPU on CUDA) per shard."""

    tensor_parallel_size: int = 1
    # A collective that waits longer than this fails the engine (a hung worker). A dead worker
    # is noticed at once, whatever this says.
    collective_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _positive(self, "tensor_parallel_size", "collective_timeout_s")


@dataclass(frozen=True)
class StructuredOutputConfig:
    """What a structured-output spec may cost: size limits checked before any compile (a spec
    over one is refused naming it), a time limit on the compile itself, and the compiled-grammar
    cache. The limits sit where xgrammar's compile time turns steep (measured on SmolLM2's 49k
    vocabulary: a 10k-value enum compiles in 0.06 s, 30k in 1.4 s; arrays nested 128 deep in
    0.14 s, 500 deep in 5.5 s; a 20k-word regex alternation in 0.5 s, 60k in 2.7 s)."""

    max_spec_bytes: int = 256 << 10  # a schema's JSON text, a grammar, a choice list
    max_schema_depth: int = 64  # JSON nesting of the schema document
    max_enum_values: int = 4096  # enum and const values, summed over the schema
    max_schema_properties: int = 2048  # property names, summed over the schema
    max_choices: int = 4096  # guided_choice entries
    max_regex_chars: int = 16 << 10
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 64  # compiled grammars kept (LRU, keyed by the spec's hash)
    max_concurrent_compiles: int = 4  # compiles running at once; more are refused as busy

    def __post_init__(self) -> None:
        _positive(self, "max_spec_bytes", "max_schema_depth", "max_enum_values",
                  "max_schema_properties", "max_choices", "max_regex_chars",
                  "grammar_compile_timeout_s", "grammar_cache_size", "max_concurrent_compiles")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, shared by the CLI, the offline API and the server."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)

    def __post_init__(self) -> None:
        # Each rank would need its shard of every adapter's B (and A of row-parallel layers);
        # refused before any worker starts rather than failing inside one.
        if self.parallel.tensor_parallel_size > 1 and (self.model.lora_modules
                                                       or self.model.enable_lora):
            raise ConfigError("LoRA adapters (--lora, --enable-lora) are not served with "
                              "--tensor-parallel-size > 1")
        max_cpu, max_running = self.model.max_cpu_loras, self.scheduler.max_loras
        if max_cpu and max_running > max_cpu:
            # Running requests' adapters stay in memory: the cap must hold max_loras of them.
            raise ConfigError(f"--max-cpu-loras ({max_cpu}) must be at least --max-loras "
                              f"({max_running})")

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build from flat keyword options (CLI flags, `LLM(**kwargs)`), routing each to its
        part."""
        parts: dict[str, dict[str, object]] = {"model": {}, "cache": {}, "scheduler": {},
                                               "parallel": {}, "structured": {}}
        owners = {name: part for part, klass in (("model", ModelConfig), ("cache", CacheConfig),
                                                  ("scheduler", SchedulerConfig),
                                                  ("parallel", ParallelConfig),
                                                  ("structured", StructuredOutputConfig))
                  for name in (f.name for f in dataclasses.fields(klass))}
        for key, value in options.items():
            if value is None and key != "model":
                continue
            if key not in owners:
                raise ConfigError(f"unknown engine option {key!r}")
            parts[owners[key]][key] = value
        return cls(model=ModelConfig(**parts["model"]),  # type: ignore[arg-type]
                   cache=CacheConfig(**parts["cache"]),  # type: ignore[arg-type]
                   scheduler=SchedulerConfig(**parts["scheduler"]),  # type: ignore[arg-type]
                   parallel=ParallelConfig(**parts["parallel"]),  # type: ignore[arg-type]
                   structured=StructuredOutputConfig(
                       **parts["structured"]))  # type: ignore[arg-type]


def draft_model_path(speculative: str) -> str | None:
    """The draft model a `speculative` setting names ("draft:PATH"), else None."""
    method, sep, path = speculative.partition(":")
    return path if method == "draft" and sep and path else None


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}")


TpotTarget = tuple[float | None, tuple[float | None, float | None, float | None]]


def parse_tpot_target(text: str) -> TpotTarget:
    """'100' -> 100 ms for every tier; 'off' or '0' -> no target (the fixed token budget);
    '0:50,1:100,2:200' -> per tier; '100,0:50' -> 100 ms, tier 0 tighter. A tier left out
    follows the plain value, or the machine-derived default when there is none."""
    plain: float | None = None
    tiers: list[float | None] = [None, None, None]
    try:
        for part in str(text).replace(" ", "").split(","):
            tier, _, value = part.rpartition(":")
            ms = 0.0 if value.lower() == "off" else float(value)
            if ms < 0 or ms != ms:
                raise ValueError
            if not tier:
                plain = ms
            elif tier in ("0", "1", "2"):
                tiers[int(tier)] = ms
            else:
                raise ValueError
    except ValueError:
        raise ConfigError(
            f"expected MS, off, or TIER:MS,... (tiers 0, 1, 2), got {text!r}") from None
    return plain, (tiers[0], tiers[1], tiers[2])
