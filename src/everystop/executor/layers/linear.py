"""Linear layers that route decode-sized inputs to a weight-streaming CPU kernel.

With 16-bit weights and only a few rows (single-stream decode), the library GEMM leaves most
of the memory bandwidth unused; `cpu_ops.linear_small` streams each weight row once and
accumulates in fp32. Larger inputs (prefill chunks, big decode batches) are compute-bound and
stay on the library GEMM (oneDNN / MKL), as does every other device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from everystop.executor.layers import cpu_ops

# Up to this many rows the streaming kernel wins (measured in docs/perf/profile.md).
SMALL_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (no bias), x: [rows, in]."""
    if (x.dim() == 2 and x.shape[0] <= SMALL_ROWS and weight.dtype != torch.float32
            and cpu_ops.use_fused(x)):
        return cpu_ops.linear_small(x, weight)
    return F.linear(x, weight)


class Linear(nn.Linear):
    """nn.Linear without bias whose forward goes through `linear` (same parameter names)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
