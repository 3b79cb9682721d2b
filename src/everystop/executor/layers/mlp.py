"""SwiGLU feed-forward block with a fused gate/up projection (column-parallel) and a
row-parallel down projection: one all-reduce per block under tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from everystop.executor.layers.cpu_kernels import CpuKernels
from everystop.executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from everystop.executor.layers.parallel import SINGLE, ParallelContext, shard_range


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int,
                 ctx: ParallelContext = SINGLE, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        start, self.intermediate_size = shard_range(intermediate_size, ctx.world_size, ctx.rank)
        # NOTE: the full weight's rows [0, I) are the gate projection, [I, 2I) the up projection;
        # each rank keeps the same slice of both, so its output still splits into gate | up.
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, ctx,
                                                 kernels=kernels)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, ctx,
                                           (start, self.intermediate_size), kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x), self.kernels))


def silu_mul(gate_up: torch.Tensor, kernels: CpuKernels | None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] (equal halves) along the last dim."""
    if kernels is not None and kernels.handles(gate_up):
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
