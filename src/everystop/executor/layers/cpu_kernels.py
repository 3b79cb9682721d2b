"""The CPU kernels (csrc/*.cpp): paged attention, the decode GEMV and the fused element-wise
ops, built once per instruction set and chosen at run time from the CPU's flags.

The same sources compile into one library per ISA, each with its own vector width (8 floats
for AVX2, 16 for AVX-512) and its own op namespace (``torch.ops.everystop_<isa>``), so one
install serves AVX2, AVX-512 and AVX512-BF16 machines and a machine can run (and test) every
build it can execute. Libraries are built lazily into the torch extensions dir
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and loaded from there
afterwards. A failed build logs a warning and the next ISA down is tried; with none, the
layers run plain torch.

The choice is made once, when the model is built (``ModelConfig.cpu_kernels``), and handed to
the layers as a `CpuKernels` object: nothing is read from the environment on the hot path.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "paged_attention.cpp", _CSRC / "fused_ops.cpp", _CSRC / "decoder_stack.cpp"]
_SOURCES += [_CSRC / "quant_linear.cpp"]  # block-quantized weights (layers/quant.py)
_SOURCES += [_CSRC / "moe_experts.cpp"]  # the decoder stack's mixture-of-experts block
_SOURCES += [_CSRC / "lora_delta.cpp"]  # LoRA deltas of rows over several adapters
_HEADERS = [_CSRC / "simd.h"]  # included by every source
_HEADERS += [_CSRC / "lora.h"]  # the LoRA kernel's interface (lora_delta.cpp, decoder_stack.cpp)
_HEADERS += [_CSRC / "int_dots.h"]  # the integer block dots (quant_linear.cpp, moe_experts.cpp)
_HEADERS += [_CSRC / "block_x16.h"]  # interleaved block weights (quant_linear.cpp)

# -fno-math-errno: libm calls need not set errno. (It does not make GCC vectorize std::exp:
# glibc declares its vector variants only under -ffast-math, hence exp_v in csrc/simd.h.)
_COMMON_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]
_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Isa:
    name: str
    cflags: tuple[str, ...]
    needs: frozenset[str]  # /proc/cpuinfo flags the build's instructions require


# Best first. "generic" has no -march: the compiler's baseline (SSE2 on x86-64, NEON on arm64).
ISAS: tuple[Isa, ...] = (
    Isa("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16", "-DES_W=16"), _V4 | {"avx512_bf16"}),
    Isa("avx512", ("-march=x86-64-v4", "-DES_W=16"), _V4),
    Isa("avx2", ("-march=x86-64-v3", "-DES_W=8"), _V3),
    Isa("generic", ("-DES_W=8",), frozenset()),
)
ISA_NAMES = tuple(isa.name for isa in ISAS)
CHOICES = ("auto", "off", *ISA_NAMES)  # values of ModelConfig.cpu_kernels

# Rows (query tokens x heads of one kv group) that share one pass over the K/V blocks: large
# enough to amortize loading a block, small enough that a prefill chunk splits into many items
# for the threads to share.
ROWS_PER_ITEM = 24
# The ops each library registers (csrc/*.cpp).
_OPS = ("paged_attention", "rms_norm", "add_rms_norm_", "silu_mul", "rope_", "rope_write_kv_",
        "argmax_rows", "linear_small", "decoder_stack")
_OPS += ("linear_q_small", "linear_q_tiled", "linear_q_tiled_bf16", "dequantize")
_OPS += ("linear_q_small_path", "int_dot_paths")  # decode dot paths, for tests and benchmarks
_OPS += ("round_int8_blocks",)
_OPS += ("paged_attention_ext", "decoder_stack_ext")  # the families' differences as parameters
_OPS += ("lora_add_",)
_OPS += ("moe_block",)  # a sparse mixture-of-experts block (csrc/moe_experts.cpp)
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NO_LORA_ROWS = torch.empty(0, dtype=torch.int64)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo has none, e.g. not Linux on x86),
    less what the environment caps: with ATEN_CPU_CAPABILITY=avx2 or ONEDNN_MAX_CPU_ISA=AVX2
    (an AVX2 machine reproduced on a wider one), no AVX-512 or AMX flag, so every default
    (kernel build, activation dtype) is the one an AVX2 machine gets."""
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if (os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2"
            or os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2"):
        flags = frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    return flags


def runnable_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The builds this CPU can execute, best first ("generic" always)."""
    flags = cpu_flags() if flags is None else flags
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return [isa.name for isa in ISAS if isa.name == "generic" or (x86 and isa.needs <= flags)]


_lock = threading.Lock()
_libraries: dict[str, bool] = {}  # ISA -> whether its library loaded (absent: not tried yet)


def library_available(isa: str) -> bool:
    """Build/load the library for `isa` if not tried yet; True if its ops can be called."""
    if isa not in _libraries:
        with _lock:
            if isa not in _libraries:
                _libraries[isa] = _build(_isa(isa))
    return _libraries[isa]


def _isa(name: str) -> Isa:
    for isa in ISAS:
        if isa.name == name:
            return isa
    raise ValueError(f"unknown CPU kernel ISA {name!r}; expected one of {ISA_NAMES}")


def _build(isa: Isa) -> bool:
    try:
        _load_or_build(isa)
        getattr(torch.ops, f"everystop_{isa.name}").paged_attention  # noqa: B018 - registered?
        return True
    except Exception as exc:  # any compiler/loader failure means "try the next one down"
        logger.warning("CPU kernels for %s unavailable: %s", isa.name, exc)
        return False


def _load_or_build(isa: Isa) -> None:
    """Load the built library straight from its cache directory, or build it there first.

    NOTE: the directory is named after a hash of the sources, their header, the flags and the
    torch version, and those files are copied into it, so checkouts at different paths (or an
    installed package next to a source tree) share one build instead of rebuilding each
    other's, and a cached build is loaded without running the compiler's up-to-date check
    (seconds at startup).
    """
    cflags = [*_COMMON_CFLAGS, *isa.cflags, f"-DES_NS=everystop_{isa.name}"]
    files = [*_SOURCES, *_HEADERS]
    texts = [src.read_bytes() for src in files]
    digest = hashlib.sha256(b"\0".join([*texts, " ".join(cflags).encode(),
                                          torch.__version__.encode()])).hexdigest()[:12]
    name = f"everystop_kernels_{isa.name}_{digest}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or _default_build_root()
    build_dir = Path(root) / name
    library = build_dir / f"{name}.so"
    if library.is_file() and not (build_dir / "lock").exists():
        torch.ops.load_library(str(library))
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    copies = []
    for src, text in zip(files, texts, strict=True):
        copy = build_dir / src.name
        if not copy.is_file() or copy.read_bytes() != text:
            tmp = copy.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(text)
            os.replace(tmp, copy)
        if src in _SOURCES:
            copies.append(str(copy))
    from torch.utils.cpp_extension import load  # only to build: it imports setuptools

    load(name=name, sources=copies, build_directory=str(build_dir), extra_cflags=cflags,
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def _default_build_root() -> str:
    """torch.utils.cpp_extension.get_default_build_root(), without importing that module: it
    imports setuptools and distutils (95 modules, ~4.4 MiB resident that a server loading a
    cached build never uses)."""
    from torch import _appdirs

    return os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))


# Keyword-only: a flag inserted among the others can never shift a positional call's
# arguments into the wrong flags.
@dataclass(frozen=True, kw_only=True)
class CpuKernels:
    """One ISA's kernel library, as the layers call it.

    `fp32_gemm_for_16bit`: multiply 16-bit weights in fp32 for compute-bound inputs. On CPUs
    without AMX or AVX512-BF16, oneDNN's bf16 GEMM runs at about half the fp32 rate; the result
    is what the bf16 GEMM gives (fp32 accumulation, rounded once to bf16). False (bf16 timed
    faster) also sends block weights meeting bf16 activations to bf16 tiles.
    """

    isa: str
    fp32_gemm_for_16bit: bool = True
    int8_decode_dot: bool = False  # ModelConfig.int8_decode_dot
    # Block weights in passes over the GEMV's rows take bf16 tiles and the bf16 GEMM whatever
    # x's dtype (fp32 x rounded to bf16 on the way in): executor/block_gemm_choice.py.
    block_gemm_bf16: bool = False
    # ModelConfig.batch_invariant: a row computes the same whatever else is in the pass. Every
    # linear takes the GEMV kernels (each output sums in one order for any row count) and
    # attention sees every query token as a one-token sequence (the decode kernel's order,
    # never the prefill tiles'), so a prompt chunk's rows compute as decoded rows do.
    batch_invariant: bool = False

    @functools.cached_property
    def ops(self) -> SimpleNamespace:
        """The library's ops as resolved overloads: a decode step makes ~200 calls, and an
        OpOverloadPacket looks its overload up on every one."""
        namespace = getattr(torch.ops, f"everystop_{self.isa}")
        return SimpleNamespace(**{name: getattr(namespace, name).default for name in _OPS})

    @functools.cached_property
    def fp32_activations(self) -> CpuKernels:
        """These kernels with int8_decode_dot and block_gemm_bf16 off, for a vocabulary
        projection held in the file's block layout (its rows not a multiple of 16): there its
        Q8_0 GEMV (49152 x 576 on the default model) ran slower on integer dots than widened
        to fp32 (1.04-1.5x, AVX512-VNNI, Zen 4); only the interleaved layout pays for them."""
        if self.int8_decode_dot or self.block_gemm_bf16:
            return dataclasses.replace(self, int8_decode_dot=False, block_gemm_bf16=False)
        return self

    def handles(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu"

    def paged_attention(self, q: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """Attention through the block tables; returns q's dtype. `window` > 0: a sliding
        window (blocks wholly before it are never read); `softcap` > 0: capped scores."""
        if self.batch_invariant:
            block_tables, query_start_loc, seq_lens = one_query_per_token(
                q.shape[0], block_tables, query_start_loc, seq_lens)
        # q is small next to the caches, so it is handed over in fp32 and the output cast
        # back: one kernel instantiation per cache dtype instead of one per (q, cache) pair.
        tensors = (q.float().contiguous(), key_cache.contiguous(), value_cache.contiguous(),
                   block_tables.long().contiguous(), query_start_loc.long().contiguous(),
                   seq_lens.long().contiguous())
        if window > 0 or softcap > 0:
            out = self.ops.paged_attention_ext(*tensors, float(scale), ROWS_PER_ITEM,
                                               int(window), float(softcap))
        else:
            out = self.ops.paged_attention(*tensors, float(scale), ROWS_PER_ITEM)
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * to_dtype(x * rsqrt(mean(x^2) + eps)) over the last dim, fp32 inside."""
        shape = x.shape
        return self.ops.rms_norm(x.reshape(-1, shape[-1]), weight, eps).view(shape)

    def add_rms_norm_(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """residual += x in place; returns rms_norm(residual) (both [rows, dim])."""
        return self.ops.add_rms_norm_(residual, x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] along the last dim."""
        return self.ops.silu_mul(gate_up)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] in place by fp32 half tables [T, head_dim // 2]."""
        self.ops.rope_(x, cos, sin)
        return x

    def rope_write_kv_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
        """Rotate the q and k heads of qkv [T, (heads + 2 kv_heads) * head_dim] in place, then
        store k and v into their cache slots (one per token)."""
        self.ops.rope_write_kv_(qkv, cos, sin, key_cache, value_cache, slot_mapping,
                                num_heads, num_kv_heads)

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """First index of each row's maximum of a float32 [N, V] (torch.argmax is ~10x
        slower)."""
        return self.ops.argmax_rows(x)

    def linear_small(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [rows <= 64, in] @ weight.T streaming the weights once, fp32 accumulation."""
        return self.ops.linear_small(x, weight)

    def decoder_stack(self, x: torch.Tensor, weights: list[torch.Tensor], formats: list[int],
                      key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                      cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, final_norm: torch.Tensor, eps: float,
                      scale: float, num_heads: int, num_kv_heads: int,
                      qkv_biases: Sequence[torch.Tensor] = (),
                      qk_norms: Sequence[torch.Tensor] = (), windows: Sequence[int] = (),
                      softcap: float = 0.0, out_norms: Sequence[torch.Tensor] = (),
                      gelu_tanh: bool = False, local_rope: Sequence[torch.Tensor] = (),
                      moe: StackMoe | None = None, lora_slots: torch.Tensor | None = None,
                      lora_weights: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """Every decoder layer and the final norm for x [rows <= 64, hidden] in one call, with
        the kernels the layers call one by one (bit-identical results; csrc/decoder_stack.cpp).
        `weights`: per layer [input norm, qkv, o, post-attention norm, gate_up, down];
        `formats`: per layer the four linears' format codes (0 dense, else block format).
        The families' differences, each empty where unused: `qkv_biases` one per layer,
        `qk_norms` (q_norm, k_norm) per layer, `windows` one per layer (0: none), `softcap`,
        `out_norms` (attention output norm, MLP output norm) per layer, `gelu_tanh` (GeGLU),
        `local_rope` (cos, sin) for the windowed layers, `moe` the layers' experts (their
        stacked gate_up and down then stand in `weights` for the MLP's).
        LoRA: `lora_slots` [rows] int64, each row's index into the pass's adapters (-1: base),
        and `lora_weights`, per adapter, per layer, per part (q, k, v, o, gate, up, down) its
        (A, B^T), empty tensors where the adapter leaves the part alone (see `lora_add_`)."""
        if self.batch_invariant:
            block_tables, query_start_loc, seq_lens = one_query_per_token(
                x.shape[0], block_tables, query_start_loc, seq_lens)
        lora = lora_slots is not None
        if (qkv_biases or qk_norms or windows or softcap or out_norms or gelu_tanh or local_rope
                or moe is not None or lora):
            moe = moe or _NO_MOE
            return self.ops.decoder_stack_ext(
                x, weights, formats, key_caches, value_caches, cos, sin, slot_mapping,
                block_tables, query_start_loc, seq_lens, final_norm, eps, scale, num_heads,
                num_kv_heads, ROWS_PER_ITEM, self.int8_decode_dot, list(qkv_biases),
                list(qk_norms), list(windows), float(softcap), list(out_norms), gelu_tanh,
                list(local_rope), list(moe.routers), moe.top_k, moe.renormalize, moe.chosen,
                lora_slots if lora else _NO_LORA_ROWS, list(lora_weights))
        return self.ops.decoder_stack(x, weights, formats, key_caches, value_caches, cos, sin,
                                      slot_mapping, block_tables, query_start_loc, seq_lens,
                                      final_norm, eps, scale, num_heads, num_kv_heads,
                                      ROWS_PER_ITEM, self.int8_decode_dot)

    def lora_add_(self, out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor,
                  weights: Sequence[torch.Tensor], col_offsets: Sequence[int] = (0,)
                  ) -> torch.Tensor:
        """out[:, c_p:c_p + n_p] += (x[r] @ A_kp.T) @ B_kp.T in place for each row r of adapter
        slot k = slots[r] (-1: none) and each part p; `weights` = per adapter, per part,
        (A, B^T): A [rank, in] and B^T [rank, n_p] (rows may be strided) of x's dtype, an empty
        A where adapter k leaves part p alone; c_p = col_offsets[p] (layers/lora.py's
        split_parts cuts a fused pair so)."""
        self.ops.lora_add_(out, x, slots, list(weights), list(col_offsets))
        return out

    def moe_block(self, h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor,
                  gate_up_fmt: int, down: torch.Tensor, down_fmt: int, top_k: int,
                  renormalize: bool, gemv_rows: int = sys.maxsize
                  ) -> tuple[torch.Tensor, int]:
        """A sparse MoE block on h [tokens, hidden] (layers/moe.py: router softmax, top-k,
        each chosen expert's SwiGLU over the stacked weights, format codes as the decoder stack
        takes them): (the output in h's dtype, how many experts ran). An expert that more than
        `gemv_rows` rows chose multiplies them in fp32 tiles (linear_q_tiled) instead of the
        GEMV; block weights only."""
        out, chosen = self.ops.moe_block(h.contiguous(), router, gate_up, gate_up_fmt, down,
                                         down_fmt, top_k, renormalize, self.int8_decode_dot,
                                         min(gemv_rows, sys.maxsize))
        return out, int(chosen)

    def linear_q_small(self, x: torch.Tensor, weight: torch.Tensor, fmt: int, k: int
                       ) -> torch.Tensor:
        """x [rows <= 64, k] @ W.T for W held as blocks of format code `fmt` (layers/quant.py),
        streaming the blocks once; fp32 accumulation, x's dtype out. With int8_decode_dot x is
        rounded to int8 per block and a single row takes the integer-dot path."""
        if self.int8_decode_dot:
            return self.ops.linear_q_small(x, weight, fmt, k)
        return self.ops.linear_q_small_path(x, weight, fmt, k, 0)  # 0: widen to fp32

    def linear_q_tiled(self, x: torch.Tensor, weight: torch.Tensor, fmt: int, k: int
                       ) -> torch.Tensor:
        """x [rows, k] @ W.T for any rows: W (blocks, or a dense fp16/bf16 weight for fmt 0)
        widened a cache-sized tile at a time into fp32 for the library GEMM; block weights
        meeting a bf16 x go to bf16 tiles and the bf16 GEMM where that was timed faster
        (`fp32_gemm_for_16bit` False). With int8_decode_dot block weights meet x rounded as
        the decode GEMV rounds it, so a token computes the same in a prefill chunk as decoded
        alone; with block_gemm_bf16 they meet x rounded to bf16 in bf16 tiles instead."""
        if self.block_gemm_bf16 and fmt != 0:
            xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
            out = self.ops.linear_q_tiled_bf16(xb, weight, fmt, k)
            return out if out.dtype == x.dtype else out.to(x.dtype)
        if self.int8_decode_dot and fmt != 0:
            out = self.ops.linear_q_tiled(self.ops.round_int8_blocks(x), weight, fmt, k)
            return out if out.dtype == x.dtype else out.to(x.dtype)
        if fmt != 0 and self.bf16_tiles(x.dtype):
            return self.ops.linear_q_tiled_bf16(x, weight, fmt, k)
        return self.ops.linear_q_tiled(x, weight, fmt, k)

    def bf16_tiles(self, x_dtype: torch.dtype) -> bool:
        """Whether block weights meeting x of this dtype take bf16 tiles and the bf16 GEMM
        (linear_q_tiled)."""
        return x_dtype == torch.bfloat16 and (
            self.block_gemm_bf16 or (not self.fp32_gemm_for_16bit and not self.int8_decode_dot))

    def dequantize(self, weight: torch.Tensor, fmt: int, k: int) -> torch.Tensor:
        """The fp32 [n, k] weight that blocks (or a dense 16-bit weight, fmt 0) hold."""
        return self.ops.dequantize(weight, fmt, k)


@dataclass(frozen=True)
class StackMoe:
    """The decoder stack's mixture-of-experts layers: `routers` one per layer ([E, H]; an
    empty tensor for a layer whose MLP is dense), each token's `top_k` experts by softmax
    weight (divided by their sum with `renormalize`); the stack writes into `chosen` (int64,
    one per layer) how many experts each layer ran."""

    routers: Sequence[torch.Tensor]
    top_k: int
    renormalize: bool
    chosen: torch.Tensor


_NO_MOE = StackMoe((), 0, False, torch.empty(0, dtype=torch.long))


def one_query_per_token(num_tokens: int, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same attention with each of the `num_tokens` query tokens as its own one-token
    sequence over its sequence's blocks, up to and including itself: (block_tables,
    query_start_loc, seq_lens) for that packing. The kernel then runs a prompt chunk's rows
    exactly as decode rows, one work item each, whatever the chunking::

        seq s, qlen 3, seq_len L:  tokens t0 t1 t2  ->  3 sequences of lengths L-2, L-1, L
    """
    num_seqs = seq_lens.shape[0]
    if num_tokens == num_seqs:  # one query token per sequence already
        return block_tables, query_start_loc, seq_lens
    qsl = query_start_loc.long()
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), qsl[1:] - qsl[:-1],
                                           output_size=num_tokens)
    tokens = torch.arange(num_tokens)
    lens = seq_lens.long()[seq_of_token] - (qsl[1:][seq_of_token] - 1 - tokens)
    return block_tables[seq_of_token], torch.arange(num_tokens + 1), lens


def load_cpu_kernels(choice: str = "auto", fp32_gemm_for_16bit: bool = True,
                     int8_decode_dot: bool = False, batch_invariant: bool = False
                     ) -> CpuKernels | None:
    """The kernels for `choice`: "auto" = the best build this CPU runs that compiles, "off" =
    None (plain torch), or an ISA name (an error if this CPU cannot run it or it fails to
    build)."""
    if choice == "off":
        return None
    if choice == "auto":
        for name in runnable_isas():
            if library_available(name):
                return CpuKernels(isa=name, fp32_gemm_for_16bit=fp32_gemm_for_16bit,
                                  int8_decode_dot=int8_decode_dot,
                                  batch_invariant=batch_invariant)
        return None
    _isa(choice)  # an unknown name is a ValueError
    if choice not in runnable_isas():
        raise ValueError(f"CPU kernels {choice!r} need CPU flags this machine lacks "
                         f"(it runs: {', '.join(runnable_isas())})")
    if not library_available(choice):
        raise RuntimeError(f"CPU kernels {choice!r} failed to build (see the warning above)")
    return CpuKernels(isa=choice, fp32_gemm_for_16bit=fp32_gemm_for_16bit,
                      int8_decode_dot=int8_decode_dot, batch_invariant=batch_invariant)
