"""SwiGLU feed-forward block with a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from everystop.executor.layers import cpu_ops
from everystop.executor.layers.linear import Linear


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # NOTE: rows [0, I) are the gate projection, rows [I, 2I) the up projection.
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_ops.use_fused(gate_up):
            return self.down_proj(cpu_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
