"""Fused CPU ops (csrc/fused_ops.cpp) for the layers' non-matmul work, and the switch that says
when to use them.

Each op replaces a chain of small ATen ops; at decode batch sizes their dispatch overhead, not
their arithmetic, is the cost. The layers call `use_fused(x)` and fall back to plain torch on
other devices, when the extension did not build, or when disabled with EVERYSTOP_FUSED_OPS=0
(benchmarks compare both ways; tests check they agree).
"""

from __future__ import annotations

import os

import torch

from everystop.executor.layers import attention_cpu

FUSED_ENV = "EVERYSTOP_FUSED_OPS"
_enabled = os.environ.get(FUSED_ENV, "1").strip() not in ("0", "false", "no", "off")


def set_enabled(enabled: bool) -> None:
    """Turn the fused path on or off for this process (benchmarks, tests)."""
    global _enabled
    _enabled = enabled


def use_fused(x: torch.Tensor) -> bool:
    """Whether the fused kernels should handle this tensor."""
    return _enabled and x.device.type == "cpu" and attention_cpu.kernel_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * to_dtype(x * rsqrt(mean(x^2) + eps)) over the last dim, fp32 inside."""
    shape = x.shape
    out = torch.ops.everystop.rms_norm(x.reshape(-1, shape[-1]), weight, eps)
    return out.view(shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    return torch.ops.everystop.silu_mul(gate_up)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place by fp32 half tables cos/sin [T, head_dim // 2]."""
    torch.ops.everystop.rope_(x, cos, sin)
    return x


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """First index of each row's maximum of a float32 [N, V] (torch.argmax is ~10x slower)."""
    return torch.ops.everystop.argmax_rows(x)


def linear_small(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows <= 8, in] @ weight.T streaming the weights once, fp32 accumulation; x's dtype."""
    return torch.ops.everystop.linear_small(x, weight)
