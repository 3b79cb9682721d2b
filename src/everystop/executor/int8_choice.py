"""`--int8-decode-dot auto`: whether block weights meet int8 activations, with the reason.

The int8 rounding of activations (32 values per scale, as llama.cpp) lets the decode GEMVs
on Q8_0/Q4_0/Q4_1 blocks take integer dot products: it pays where the projections are held as
blocks and the kernel build has an integer dot path on this CPU (AVX2 maddubs, AVX-VNNI or
AVX512-VNNI). Float and 16-bit weights never take it, and without an integer path the rounding
would only cost time. Its error is far below the block weights' own quantization error
(tests/executor/test_int8_vs_transformers.py).
"""

from __future__ import annotations

from collections.abc import Callable

from everystop.config import ModelConfig
from everystop.executor.layers.cpu_kernels import CpuKernels

# The kernels' dot path codes (csrc/quant_linear.cpp, DotPath) by name; 0 is fp32 widening.
DOT_PATH_NAMES = {1: "AVX2 maddubs", 2: "AVX-VNNI", 3: "AVX512-VNNI"}


def integer_dot_path(kernels: CpuKernels) -> str | None:
    """The integer dot path the kernels take on this CPU (the best they run), or None."""
    best = max(kernels.ops.int_dot_paths())
    return DOT_PATH_NAMES.get(best)


def choose_int8_decode_dot(config: ModelConfig, kernels: CpuKernels | None, blocks: bool,
                           dot_path: Callable[[CpuKernels], str | None] = integer_dot_path,
                           ) -> tuple[bool, str]:
    """Whether `config` runs with int8 activations and why: as configured ("on"/"off"), else
    what `auto` picks here; `blocks`: whether the weights are held as quantized blocks. The
    probes are arguments so tests can patch them."""
    if config.int8_decode_dot != "auto":
        return config.int8_decode_dot == "on", "as configured"
    if kernels is None:
        return False, "the CPU kernels are off"
    if not blocks:
        return False, "the weights are not quantized blocks (Q8_0/Q4_0/Q4_1)"
    path = dot_path(kernels)
    if path is None:
        return False, f"the {kernels.isa} kernels have no integer dot path on this CPU"
    return True, (f"the weights are quantized blocks and the {kernels.isa} kernels take "
                  f"integer dot products ({path})")
