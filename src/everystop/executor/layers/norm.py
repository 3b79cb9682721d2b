"""RMSNorm, computed in float32 whatever the activation dtype (as the reference models do)."""

from __future__ import annotations

import torch
from torch import nn

from everystop.executor.layers import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.use_fused(x) and x.stride(-1) == 1:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # NOTE: cast back before the weight multiply, matching Llama's reference numerics.
        return self.weight * x32.to(dtype)
