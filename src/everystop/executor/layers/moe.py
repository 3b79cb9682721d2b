"""Sparse mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE): a router picks each
token's top-k experts, the rows routed to an expert are gathered and run through that expert
alone, and only the experts some row chose are read at all.

Every expert is a SwiGLU. The experts' weights are stacked expert-major into two matrices held
as loaded (dense, 16-bit or GGUF blocks; see HeldWeight), so expert e is a contiguous row range
that goes through the same linear kernels as a dense layer::

    gate_up  [E * 2I, H]   rows [e*2I, e*2I + I): gate of e   [e*2I + I, (e+1)*2I): up of e
    down     [E * H,  I]   rows [e*H, (e+1)*H): down of e

Under tensor parallelism each rank keeps its share of every expert's intermediate size (the
gate/up rows and down columns of a SwiGLU's shard), and the block's output is one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from everystop.executor.layers.cpu_kernels import CpuKernels
from everystop.executor.layers.linear import (
    DENSE,
    ColumnParallelLinear,
    HeldWeight,
    RowParallelLinear,
    gemv_rows,
    linear,
)
from everystop.executor.layers.parallel import SINGLE, ParallelContext
from everystop.executor.layers.quant import INTERLEAVE_ROWS, format_code
from everystop.executor.layers.weight_reads import WeightReads


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int64 [T, k]) as Mixtral and Qwen3-MoE define them:
    softmax over all experts in fp32, the k largest probabilities, then, with `renormalize`
    (Mixtral always, Qwen3-MoE under norm_topk_prob), those k divided by their sum.

    NOTE: the order matters: softmax before top-k keeps, without renormalizing, each weight's
    share of the whole distribution; renormalized it equals a softmax over the k logits."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def silu_mul(gate_up: torch.Tensor, kernels: CpuKernels | None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] (equal halves) along the last dim."""
    if kernels is not None and kernels.handles(gate_up):
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Router(nn.Module):
    """The gate: one logit per expert, [E, H] held in the model dtype (small, never blocks)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


class Experts(nn.Module):
    """E SwiGLU experts in two stacked matrices (see the module docstring). With `reads`,
    each pass adds there the bytes of the experts it ran (their gate/up/down rows as held)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 ctx: ParallelContext = SINGLE, kernels: CpuKernels | None = None,
                 reads: WeightReads | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.reads = reads
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.gate_up_proj = ColumnParallelLinear(hidden_size,
                                                 [intermediate_size] * (2 * num_experts), ctx,
                                                 kernels=kernels)
        self.down_proj = RowParallelLinear(intermediate_size, num_experts * hidden_size, ctx,
                                           kernels=kernels)
        # This rank's share of one expert's gate_up rows.
        self.local_gate_up = 2 * self.gate_up_proj.out_sizes[0]
        # Held interleaved only where every expert's rows are whole groups of 16. The expert
        # kernel (csrc/moe_experts.cpp) then runs each expert through the projection GEMV
        # (its 16-column dots) rather than its own standard-layout integer dots.
        self.gate_up_proj.interleave_blocks = self.local_gate_up % INTERLEAVE_ROWS == 0
        self.down_proj.interleave_blocks = hidden_size % INTERLEAVE_ROWS == 0

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU of x [n, H] (this rank's partial sum under tensor parallelism),
        reading expert e's rows of the stacked weights only."""
        gu, down = self.gate_up_proj, self.down_proj
        rows = self.local_gate_up
        h = linear(x, gu.weight[e * rows:(e + 1) * rows], self.kernels, gu.weight_format,
                   gu.weight_cols)
        h = silu_mul(h, self.kernels)
        w = down.weight[e * self.hidden_size:(e + 1) * self.hidden_size]
        return linear(h, w, self.kernels, down.weight_format, down.weight_cols)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """sum_j weights[t, j] * expert(ids[t, j])(x[t]) for every row t, in fp32 [T, H].

        Rows are grouped by expert (a stable sort of the T*k choices), so each chosen expert
        runs once on all its rows; the sums add experts in ascending order."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        slot_weights = weights.reshape(-1, 1)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        chosen = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            chosen += 1
            slots = order[start:start + n]
            start += n
            rows = slots // top_k
            y = self.expert(e, x[rows])
            out.index_add_(0, rows, y.float() * slot_weights[slots])
        self.count_reads(chosen)
        return out

    def count_reads(self, chosen: int) -> None:
        """A pass ran `chosen` experts: their bytes are what it read of the stacked weights."""
        if self.reads is not None:
            self.reads.add_partial(chosen * self.expert_bytes())

    def expert_bytes(self) -> int:
        """The bytes of one expert's weights on this rank, as held (blocks or float)."""
        return ((self.gate_up_proj.weight.nbytes + self.down_proj.weight.nbytes)
                // self.num_experts)

    def stacked_weights(self) -> list[torch.Tensor]:
        """The stacked expert matrices, which a pass reads only in part."""
        return [self.gate_up_proj.weight, self.down_proj.weight]


class SparseMoeBlock(nn.Module):
    """Router then experts; a drop-in for the decoder layer's SwiGLU (`mlp`). With the CPU
    kernels, where every expert's linears would take the decode GEMV, the whole block is one
    kernel call (`CpuKernels.moe_block`, the code the decoder stack runs), which with int8
    activations and Q8_0/Q4_0 experts multiplies each expert's rows on integer dots."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, ctx: ParallelContext = SINGLE,
                 kernels: CpuKernels | None = None, reads: WeightReads | None = None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"experts per token ({top_k}) must be in 1..{num_experts}")
        self.ctx = ctx
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Router(hidden_size, num_experts)
        self.experts = Experts(hidden_size, intermediate_size, num_experts, ctx, kernels, reads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        kernels = experts.kernels
        if kernels is not None and self._whole_block_kernel(x, kernels):
            gate_up, down = experts.gate_up_proj, experts.down_proj
            out, chosen = kernels.moe_block(x, self.gate.weight, gate_up.weight,
                                            _format_code(gate_up), down.weight,
                                            _format_code(down), self.top_k, self.renormalize,
                                            self._expert_gemv_rows(x, kernels))
            experts.count_reads(chosen)
            return out
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = experts(x, weights, ids)
        return self.ctx.all_reduce(out if out.dtype == x.dtype else out.to(x.dtype))

    def _whole_block_kernel(self, x: torch.Tensor, kernels: CpuKernels) -> bool:
        """Whether the whole block runs as one kernel call (csrc/moe_experts.cpp, which the
        decoder stack runs too): on one rank, where each expert's linears take what the kernel
        runs: the decode GEMV (x's rows are at least any expert's), or, for block weights
        meeting fp32 tiles, the GEMV up to its rows and the tiles past them."""
        projections = (self.experts.gate_up_proj, self.experts.down_proj)
        if (self.ctx.world_size != 1 or x.dim() != 2 or not x.shape[0]
                or not kernels.handles(x)
                or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
                or not all(m.weight.is_contiguous() for m in projections)):
            return False
        return (x.shape[0] <= self._expert_gemv_rows(x, kernels)
                or _fp32_tiles(projections, x.dtype, kernels))

    def _expert_gemv_rows(self, x: torch.Tensor, kernels: CpuKernels) -> int:
        """Up to how many rows an expert's linears take the GEMV (linear()'s choice)."""
        return min(gemv_rows(m.weight, m.weight_format, x.dtype, kernels)
                   for m in (self.experts.gate_up_proj, self.experts.down_proj))


def _fp32_tiles(projections: tuple[HeldWeight, ...], x_dtype: torch.dtype,
                kernels: CpuKernels) -> bool:
    """Whether linear() multiplies these projections past the GEMV's rows in fp32 tiles of
    their blocks (CpuKernels.linear_q_tiled), as the expert kernel does: block weights, no
    bf16 tiles."""
    return (not kernels.block_gemm_bf16 and not kernels.bf16_tiles(x_dtype)
            and all(m.weight_format != DENSE for m in projections))


def _format_code(m: HeldWeight) -> int:
    """A held weight's format as the kernels take it: 0 dense, else the block format's code."""
    return format_code(m.weight_format)
