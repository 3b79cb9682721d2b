"""Gated feed-forward block (SwiGLU, or GeGLU with `activation="gelu_tanh"`) with a fused
gate/up projection (column-parallel) and a row-parallel down projection: one all-reduce per
block under tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from everystop.executor.layers.cpu_kernels import CpuKernels
from everystop.executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from everystop.executor.layers.parallel import SINGLE, ParallelContext, shard_range

ACTIVATIONS = ("silu", "gelu_tanh")  # act(gate) * up; gelu_tanh: GELU's tanh approximation


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int,
                 ctx: ParallelContext = SINGLE, kernels: CpuKernels | None = None,
                 activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}")
        self.kernels = kernels
        self.activation = activation
        start, self.intermediate_size = shard_range(intermediate_size, ctx.world_size, ctx.rank)
        # NOTE: the full weight's rows [0, I) are the gate projection, [I, 2I) the up projection;
        # each rank keeps the same slice of both, so its output still splits into gate | up.
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, ctx,
                                                 kernels=kernels)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, ctx,
                                           (start, self.intermediate_size), kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "gelu_tanh":
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if self.kernels is not None and self.kernels.handles(gate_up):
            return self.down_proj(self.kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
