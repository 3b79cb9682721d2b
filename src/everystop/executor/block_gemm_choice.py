"""`--cpu-16bit-gemm auto` for block weights: whether compute-bound passes multiply them in
bf16, with the reason.

A pass with more rows than the decode GEMV takes (a prefill chunk, a many-row decode step)
widens Q8_0/Q4_0/Q4_1 blocks a tile at a time for a library GEMM. Where the CPU multiplies
bf16 natively (AVX512-BF16 or AMX) and oneDNN builds a bf16 GEMM, bf16 tiles run that GEMM at
~1.7x the fp32 one (Zen 4, the default model's projections at 128-2048 rows); fp32
activations are rounded to bf16 on the way in and the output widened back. The rounding (8
significant bits) is far finer than the 4-bit weights' own, and of the class int8
activations already take. Elsewhere the fp32 tiles stay: an emulated bf16 GEMM runs at about
half the fp32 rate, and an AVX2-only oneDNN builds none.

"auto" keeps the fp32 tiles all the same: the decode GEMV multiplies in fp32, so with bf16
tiles a row's result would depend on how many rows share its pass (a sequence decoded beside
others, or recomputed after preemption, would part from itself alone:
tests/engine/test_engine_model.py). Where int8 activations are on, the kernels run
batch-invariant and the integer-dot GEMV takes every row count instead (faster than either
tile). "native" opts in; the start-up log says where it would pay.
"""

from __future__ import annotations

from collections.abc import Callable

from everystop.config import ConfigError, ModelConfig
from everystop.executor.dtype_choice import NATIVE_BF16_FLAGS
from everystop.executor.layers.cpu_kernels import CpuKernels, cpu_flags
from everystop.executor.layers.linear import onednn_bf16_gemm_supported


def choose_block_gemm_bf16(config: ModelConfig, kernels: CpuKernels | None, blocks: bool,
                           flags: Callable[[], frozenset[str]] = cpu_flags,
                           bf16_gemm: Callable[[], bool] = onednn_bf16_gemm_supported,
                           ) -> tuple[bool, str]:
    """Whether block weights take bf16 tiles in compute-bound passes whatever the activation
    dtype, and why: "native" (refused where oneDNN has no bf16 GEMM), never under "fp32" or
    "auto" (see above; its reason says whether this CPU would gain). `blocks`: whether the
    weights are held as quantized blocks. The probes are arguments so tests can patch the CPU
    both ways."""
    if kernels is None:
        return False, "the CPU kernels are off"
    if config.batch_invariant or kernels.batch_invariant:
        return False, "batch-invariant mode multiplies every row count on the GEMV"
    if config.cpu_16bit_gemm == "fp32":
        return False, "as configured"
    if not blocks:
        return False, "the weights are not quantized blocks (Q8_0/Q4_0/Q4_1)"
    if not bf16_gemm():
        if config.cpu_16bit_gemm == "native":
            raise ConfigError("cpu_16bit_gemm 'native': this CPU's oneDNN has no bfloat16 GEMM "
                              "for the block weights' tiles (it needs AVX-512 or AMX); use "
                              "'auto' or 'fp32'")
        return False, "oneDNN builds no bf16 GEMM on this CPU"
    if config.cpu_16bit_gemm == "native":
        return True, "as configured"
    native = sorted(NATIVE_BF16_FLAGS & flags())
    if not native:
        return False, "this CPU has no native bf16 dot product (avx512_bf16 or amx_bf16)"
    return False, (f"this CPU multiplies bf16 natively ({', '.join(native)}): "
                   f"--cpu-16bit-gemm native runs block-weight prefill ~1.7x faster in bf16 "
                   f"tiles, but a row's result then depends on the pass's row count")
