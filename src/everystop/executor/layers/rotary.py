"""Rotary position embeddings (half-split "rotate_half" layout) with Llama rope scaling.

Weights are kept in the Hugging Face layout, where each head's first half of dims pairs with its
second half; GGUF checkpoints are un-permuted into this layout by the loader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from everystop.executor.layers.cpu_kernels import CpuKernels


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32, CPU) for the given rope scaling.

    Supported scaling types: none/"default", "linear", "llama3", and "longrope" (its short
    factors here; `longrope_tables` for the rest). `freq_factors` (GGUF's `rope_freqs.weight`)
    divides the frequencies, which is how llama.cpp stores llama3 scaling.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device="cpu") / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if freq_factors is not None:
        return inv_freq / freq_factors.to(device="cpu", dtype=torch.float32)
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind in LONGROPE:
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32,
                                       device="cpu")
    raise ValueError(f"unsupported rope scaling type {kind!r}")


LONGROPE = ("longrope", "su")  # Phi-3's LongRoPE ("su" in older configs)


@dataclass(frozen=True)
class LongRope:
    """LongRoPE: a sequence longer than `original_max` rotates all its new tokens with the
    long factors' frequencies, a shorter one with the short factors' (as the reference
    decides per forward of one sequence); both tables are scaled by `attention_factor`.
    NOTE: a sequence crossing `original_max` while it decodes keeps its short-factor cache
    (the reference recomputes the whole sequence there: docs/models.md)."""

    long_inv_freq: torch.Tensor
    attention_factor: float
    original_max: int

    @staticmethod
    def from_scaling(head_dim: int, theta: float, scaling: dict[str, Any],
                     max_position_embeddings: int) -> LongRope:
        original = int(scaling["original_max_position_embeddings"])
        factor = float(scaling.get("factor") or max_position_embeddings / original)
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = (1.0 if factor <= 1.0 else
                         math.sqrt(1 + math.log(factor) / math.log(original)))
        # NOTE: on the CPU explicitly: the model is built under torch.device("meta").
        steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        long = 1.0 / (theta ** steps) / torch.tensor(scaling["long_factor"],
                                                     dtype=torch.float32, device="cpu")
        return LongRope(long, float(attention), original)

    def tables(self, positions: torch.Tensor, token_seq_lens: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The short tables `cos`, `sin` with the rows of long sequences' tokens replaced by
        the long ones, all scaled."""
        long_cos, long_sin = rope_cos_sin(positions, self.long_inv_freq.to(positions.device))
        use_long = (token_seq_lens > self.original_max)[:, None]
        return (torch.where(use_long, long_cos, cos) * self.attention_factor,
                torch.where(use_long, long_sin, sin) * self.attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
    # between is interpolated smoothly so nearby positions stay distinguishable.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 half tables cos, sin [T, head_dim // 2] for the given positions.

    Computed once per forward and shared by all layers.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kernels: CpuKernels | None = None) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the per-token angles (half tables from rope_cos_sin).

    May rotate x in place (the fused CPU op does); use the returned tensor.
    """
    if kernels is not None and kernels.handles(x) and x.stride(-1) == 1:
        return kernels.rope_(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # As the reference models: the tables are cast to the activation dtype first, and
    # x * cos + rotate_half(x) * sin is rounded op by op (the same values as below).
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
