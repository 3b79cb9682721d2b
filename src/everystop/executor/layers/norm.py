"""RMSNorm, computed in float32 whatever the activation dtype (as the reference models do)."""

from __future__ import annotations

import torch
from torch import nn

from everystop.executor.layers.cpu_kernels import CpuKernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, with a residual stream, (norm(x + residual), x + residual), where the
        fused kernel updates `residual` in place (callers pass the stream they own)."""
        kernels = self.kernels
        fused = kernels is not None and kernels.handles(x) and x.stride(-1) == 1
        if residual is not None:
            if fused and x.dim() == 2 and residual.stride(-1) == 1:
                assert kernels is not None
                return kernels.add_rms_norm_(residual, x, self.weight, self.eps), residual
            residual = x + residual
            return self._norm(residual, fused), residual
        return self._norm(x, fused)

    def _norm(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        if fused:
            assert self.kernels is not None
            return self.kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # NOTE: cast back before the weight multiply, matching Llama's reference numerics.
        return self.weight * x32.to(dtype)
