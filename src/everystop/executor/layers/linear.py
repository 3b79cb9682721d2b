"""Megatron-style sharded linears and embedding.

Each layer holds only this rank's slice of the full weight and knows how to cut that slice out
of the full tensor (`shard_weight`, used by the loader), so checkpoints stay unsharded on disk::

    column-parallel  W [out, in]: rank r keeps some rows   -> output stays split over ranks
    row-parallel     W [out, in]: rank r keeps some columns -> partial sums, one all-reduce
    vocab-parallel   E [vocab, hidden]: rank r keeps a vocab range -> masked lookup + all-reduce
                                                                       (logits: gather to rank 0)

Column then row (QKV -> attention -> o_proj, gate/up -> SiLU -> down) needs one all-reduce per
pair. With world_size 1 every slice is the whole tensor and no collective runs.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from everystop.executor.layers.cpu_kernels import CpuKernels
from everystop.executor.layers.lora import LoraHook
from everystop.executor.layers.parallel import ParallelContext, shard_heads, shard_range
from everystop.executor.layers.quant import (
    DENSE,
    INTERLEAVE_ROWS,
    X16,
    QuantizedTensor,
    dequantize,
    format_code,
    interleave,
    rows_of,
)

# Up to this many rows (decode-sized inputs) weights go through the weight-streaming CPU GEMV:
# the library GEMM leaves most of the memory bandwidth unused there (measured: at 8 rows the
# whole model's projections take ~33 ms in fp32 vs ~62 ms through F.linear).
# Larger inputs are compute-bound and go to oneDNN's GEMM (see
# _gemm_fp32); other devices use F.linear.
SMALL_ROWS = 8
# Up to this many rows, 16-bit weights beside fp32 activations and block weights stay on the
# GEMV kernels too (8 rows at a time over column groups that stay in L2, so the weights stream
# from memory once), instead of being dequantized whole for a GEMM on every call: that cost a
# 9-row decode step of the default model ~3x an 8-row one. Where block weights would go to bf16
# tiles (a bf16 GEMM at ~2.5x the fp32 one) the GEMV wins only up to 16 rows. Measured per
# layer on SmolLM2-135M and Llama-3.2-1B shapes.
CHUNKED_GEMV_ROWS = 32
CHUNKED_GEMV_ROWS_BF16_TILES = 16


def gemv_rows(weight: torch.Tensor, fmt: str, x_dtype: torch.dtype, kernels: CpuKernels) -> int:
    """Up to how many rows of x linear() multiplies `weight` with the GEMV kernels: every row
    count in batch-invariant mode, where a row must sum in the same order in a prefill chunk
    as decoded alone (a library GEMM's blocking, and so its sums, depend on the row count)."""
    if kernels.batch_invariant:
        return sys.maxsize
    if fmt != DENSE:
        return CHUNKED_GEMV_ROWS_BF16_TILES if kernels.bf16_tiles(x_dtype) else CHUNKED_GEMV_ROWS
    if weight.dtype != torch.float32 and (kernels.fp32_gemm_for_16bit or x_dtype != weight.dtype):
        return CHUNKED_GEMV_ROWS
    return SMALL_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, kernels: CpuKernels | None = None,
           fmt: str = DENSE, k: int = 0) -> torch.Tensor:
    """x @ weight.T (no bias), x: [rows, in]; through the CPU kernels where they apply.

    `fmt` names how `weight` holds the matrix: DENSE (a float tensor [out, in]) or a block
    format of layers/quant.py (uint8 blocks; `k` = in)."""
    if fmt != DENSE:
        return _quantized_linear(x, weight, kernels, fmt, k)
    if kernels is not None and x.dim() == 2 and x.shape[0] and kernels.handles(x):
        if kernels.batch_invariant:
            return kernels.linear_small(x, weight.contiguous())
        if x.shape[0] <= gemv_rows(weight, fmt, x.dtype, kernels) and weight.is_contiguous():
            return kernels.linear_small(x, weight)
        if weight.dtype == torch.float32:
            out = _gemm_fp32(x.float(), weight)
            return out if out.dtype == x.dtype else out.to(x.dtype)
        if kernels.fp32_gemm_for_16bit or x.dtype != weight.dtype:
            # A 16-bit weight widened a cache-sized tile at a time: no fp32 copy is kept.
            return kernels.linear_q_tiled(x, weight.contiguous(), 0, weight.shape[1])
    if x.dtype != weight.dtype:  # a 16-bit weight held as loaded, off the CPU kernels
        return F.linear(x, weight.to(x.dtype))
    return F.linear(x, weight)


def _quantized_linear(x: torch.Tensor, blocks: torch.Tensor, kernels: CpuKernels | None,
                      fmt: str, k: int) -> torch.Tensor:
    code = format_code(fmt)
    if kernels is not None and x.dim() == 2 and x.shape[0] and kernels.handles(x):
        if x.shape[0] <= gemv_rows(blocks, fmt, x.dtype, kernels):
            return kernels.linear_q_small(x, blocks, code, k)
        return kernels.linear_q_tiled(x, blocks, code, k)
    # Plain torch (no kernels, other devices): a transient dequantized copy per call.
    return F.linear(x, dequantize(blocks, fmt, k).to(x.dtype))


class HeldWeight(nn.Module):
    """A layer whose `weight` is held as loaded: a float tensor (DENSE; a 16-bit one may stay
    16-bit next to fp32 activations) or the uint8 blocks of a layers/quant.py format."""

    weight: nn.Parameter
    weight_format: str = DENSE
    weight_cols: int = 0  # the matrix's columns (its `in` size), for block formats
    # Set on the projections LoRA adapters target, once adapters are loaded (layers/lora.py).
    lora: LoraHook | None = None
    # Whether block weights read by the CPU kernels are held interleaved 16 rows at a time
    # (layers/quant.py), for the GEMV's 16-column integer dots: only where the kernels take
    # int8 activations (the fp32 GEMV reads a group by unpacking it to the file's layout
    # first, which made a default single stream 1.5x slower); off where row slices of the
    # weight must stay whole groups and do not.
    interleave_blocks: bool = True

    def hold(self, weight: torch.Tensor | QuantizedTensor) -> None:
        """Install the loaded weight in place of the (meta) placeholder."""
        if isinstance(weight, QuantizedTensor):
            kernels = getattr(self, "kernels", None)
            if (self.interleave_blocks and kernels is not None and kernels.int8_decode_dot
                    and weight.data.device.type == "cpu"
                    and weight.data.shape[0] % INTERLEAVE_ROWS == 0):
                weight = interleave(weight)
            self.weight_format, self.weight_cols = weight.fmt, weight.cols
            weight = weight.data
        else:
            self.weight_format, self.weight_cols = DENSE, weight.shape[1]
        self.weight = nn.Parameter(weight, requires_grad=False)

    def project(self, x: torch.Tensor, kernels: CpuKernels | None) -> torch.Tensor:
        return linear(x, self.weight, kernels, self.weight_format, self.weight_cols)


def onednn_bf16_gemm_supported() -> bool:
    """Whether this CPU's oneDNN has a bf16 GEMM (AVX-512: natively with AVX512-BF16 or AMX,
    else emulated). Without one oneDNN refuses to build the primitive (an AVX2-only CPU), so
    the bf16 tiles cannot run at all."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=8)
def fp32_gemm_is_faster(dtype: torch.dtype, rows: int = 256, size: int = 1024,
                        repeats: int = 3) -> bool:
    """Whether a compute-bound GEMM on `dtype` weights runs faster widened to fp32 than in the
    library's own `dtype` GEMM, timed here (best of `repeats`, a few ms in all). Which wins
    depends on the CPU: bf16 is ~4x fp32 where AVX512-BF16 runs full width (Zen 5), ~0.5x where
    oneDNN emulates it. Timed once a process: a draft model, or a second engine, takes the
    answer its target got rather than a second, noisy timing that could choose otherwise."""
    g = torch.Generator().manual_seed(0)
    w16 = torch.randn(size, size, generator=g).to(dtype)
    x16 = torch.randn(rows, size, generator=g).to(dtype)
    w32, x32 = w16.float(), x16.float()

    def best(fn: Callable[[], torch.Tensor]) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(lambda: F.linear(x32, w32)) < best(lambda: F.linear(x16, w16))


def _onednn_available() -> bool:
    try:
        return (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_available()


def _gemm_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x @ weight.T through oneDNN's GEMM. On AMD Zen (AVX2 and AVX-512 alike) MKL's
    sgemm, what F.linear calls, runs its generic code path: measured per thread, 1-thread CPU
    time, default model's projections at 256-512 rows: oneDNN 230-238 vs MKL (packed weights)
    104-105 GFLOP/s with AVX-512, 115-116 vs 101 with AVX2.
    oneDNN reads the plain weight: no packed copy is kept beside it."""
    if not _ONEDNN:
        return F.linear(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")


RowRange = tuple[int, int]  # (start, size) along the weight's output dimension


class ColumnParallelLinear(HeldWeight):
    """The full weight is a stack of blocks (e.g. [gate; up]); each rank keeps its even share of
    every block, stacked in the same order, so a fused output still splits block by block."""

    def __init__(self, in_features: int, block_sizes: Sequence[int], ctx: ParallelContext,
                 rows: Sequence[RowRange] | None = None,
                 kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        if rows is None:
            offsets = [sum(block_sizes[:i]) for i in range(len(block_sizes))]
            shares = [shard_range(n, ctx.world_size, ctx.rank) for n in block_sizes]
            rows = [(off + start, size) for off, (start, size) in zip(offsets, shares)]
        self.rows = tuple(rows)
        self.full_out_features = sum(block_sizes)
        self.out_sizes = [size for _, size in self.rows]
        self.weight = nn.Parameter(torch.empty(sum(self.out_sizes), in_features),
                                   requires_grad=False)

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        if self.rows == ((0, full.shape[0]),):
            return full
        return torch.cat([full[start:start + size] for start, size in self.rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(x, self.kernels)
        return out if self.lora is None else self.lora(x, out)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused [q; k; v] projection. Rank r keeps its query heads and the KV heads they read, so
    its slice is [q_r; k_r; v_r] (KV heads replicated when there are fewer than ranks)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 ctx: ParallelContext, kernels: CpuKernels | None = None) -> None:
        self.heads = shard_heads(num_heads, num_kv_heads, ctx.world_size, ctx.rank)
        h, d = self.heads, head_dim
        q_full, kv_full = num_heads * d, num_kv_heads * d
        rows = [(h.q_start * d, h.num_q * d), (q_full + h.kv_start * d, h.num_kv * d),
                (q_full + kv_full + h.kv_start * d, h.num_kv * d)]
        super().__init__(hidden_size, [q_full, kv_full, kv_full], ctx, rows, kernels)
        if rows == [(0, q_full), (q_full, kv_full), (q_full + kv_full, kv_full)]:
            self.rows = ((0, q_full + 2 * kv_full),)  # the whole tensor: no copy on load


class RowParallelLinear(HeldWeight):
    """Keeps the input columns [start, start+size) and sums partial outputs over ranks."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext,
                 cols: RowRange | None = None, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.ctx = ctx
        self.kernels = kernels
        self.cols = cols or shard_range(in_features, ctx.world_size, ctx.rank)
        self.full_in_features = in_features
        self.weight = nn.Parameter(torch.empty(out_features, self.cols[1]), requires_grad=False)

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        start, size = self.cols
        # A copy, not a view: a view would keep the whole unsharded tensor alive, and the
        # decode GEMV streams contiguous rows.
        return full if size == full.shape[1] else full[:, start:start + size].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(x, self.kernels)
        return self.ctx.all_reduce(out if self.lora is None else self.lora(x, out))


class VocabParallelEmbedding(HeldWeight):
    """Rank r holds embedding rows [start, start+size). A token outside the range looks up
    zeros, so the all-reduce sum is exactly the one rank's row (x + 0 = x: no rounding)."""

    # Interleaved where the kernels take int8 activations, as every projection is: the
    # vocabulary projection's integer-dot GEMV then runs 1.8x faster than widening the file's
    # layout to fp32 (0.61 vs 1.11 ms a step on the default model's 49152 x 576 Q8_0 head,
    # AVX512-VNNI, Zen 4); a lookup gathers its rows from their groups (quant.rows_of).

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext,
                 kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.ctx = ctx
        self.kernels = kernels
        self.vocab_size = vocab_size
        self.start, self.size = shard_range(vocab_size, ctx.world_size, ctx.rank)
        self.weight = nn.Parameter(torch.empty(self.size, hidden_size), requires_grad=False)
        # The activations' dtype where the weight is held in another (None: the weight's).
        self.act_dtype: torch.dtype | None = None

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.size == full.shape[0] else full[self.start:self.start + self.size]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.world_size == 1:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.size)
        x = self._lookup(local.masked_fill(outside, 0))
        return self.ctx.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` in the activation dtype (a held 16-bit or block weight's rows are
        widened: only the rows looked up)."""
        if self.weight_format != DENSE:
            fmt = self.weight_format.removesuffix(X16)
            blocks = rows_of(self.weight, self.weight_format, self.weight_cols, ids.reshape(-1))
            kernels = self.kernels
            # The fused op widens the same values (tests/executor/test_quantized.py) in one
            # call instead of a dozen small tensor ops: ~40 us per decode step.
            rows = (kernels.dequantize(blocks, format_code(fmt), self.weight_cols)
                    if kernels is not None and kernels.handles(blocks) else
                    dequantize(blocks, fmt, self.weight_cols))
            return rows.view(*ids.shape, -1).to(self.act_dtype or torch.float32)
        x = F.embedding(ids, self.weight)
        return x if self.act_dtype is None else x.to(self.act_dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Use the rows as a vocabulary projection (an LM head, or a tied embedding): float32
        logits [N, vocab] on rank 0 (the only rank that samples), None on the others."""
        kernels = self.kernels
        if kernels is not None and not self.weight_format.endswith(X16):
            kernels = kernels.fp32_activations
        full = self.ctx.gather_last_dim(self.project(hidden, kernels), self.vocab_size)
        return None if full is None else full.float()


class ParallelLMHead(VocabParallelEmbedding):
    """An untied vocabulary projection, sharded like the embedding (one row per token)."""
