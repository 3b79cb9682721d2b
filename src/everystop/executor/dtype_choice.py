"""`--dtype auto`: the activation dtype for this device, CPU and weight file, with the reason.

On CPU, bf16 activations pay only where the CPU multiplies bf16 natively (AVX512-BF16 or AMX)
and oneDNN builds a bf16 GEMM for it, and only for float weights (F16/BF16/F32 tensors, an HF
directory): block-quantized weights (Q8_0/Q4_0/Q4_1, K-quants) run their own kernels on fp32
activations, which bf16 activations would only convert back and forth. On a GPU: bf16 where the
card has it, else fp16.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import torch

from everystop.config import ModelConfig
from everystop.executor.layers.cpu_kernels import cpu_flags
from everystop.executor.layers.linear import onednn_bf16_gemm_supported
from everystop.executor.models.loader import resolve_model_path

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# GGML tensor types whose values numpy reads directly: float weights. Every other type is
# quantized blocks.
_FLOAT_GGML_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def weights_are_blocks(path: str | None, quantization: str) -> bool:
    """Whether the projections will be held as quantized blocks: the file's own blocks kept
    (`quantization` "auto" on a GGUF whose projections are mostly quantized) or float weights
    quantized at load ("q8_0"/"q4_0")."""
    if quantization in ("q8_0", "q4_0"):
        return True
    if quantization != "auto":
        return False
    path = resolve_model_path(path)
    if os.path.isdir(path):
        return False
    from everystop.executor.models.gguf_file import GGUFFile

    try:
        tensors = GGUFFile(path).tensors
    except (OSError, ValueError):  # not a readable GGUF: the loader reports it by name
        return False
    kinds = Counter(t.tensor_type.name in _FLOAT_GGML_TYPES for t in tensors if len(t.shape) == 2)
    return kinds[False] > kinds[True]


def choose_dtype(config: ModelConfig, blocks: bool,
                 flags: Callable[[], frozenset[str]] = cpu_flags,
                 bf16_gemm: Callable[[], bool] = onednn_bf16_gemm_supported,
                 ) -> tuple[str, str]:
    """The dtype `config` runs in and why: its own when given, else what `auto` picks here;
    `blocks`: whether its weights are held as quantized blocks (`weights_are_blocks`). The
    probes are arguments so tests can patch the CPU both ways."""
    if config.dtype != "auto":
        return config.dtype, "as configured"
    device = torch.device(config.device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "this GPU has bf16"
        return "float16", "this GPU has no bf16"
    if device.type != "cpu":
        return "float32", f"no 16-bit rule for device {device.type!r}"
    native = sorted(NATIVE_BF16_FLAGS & flags())
    if not native:
        return "float32", "this CPU has no native bf16 dot product (avx512_bf16 or amx_bf16)"
    if config.cpu_kernels == "off":
        return "float32", "the CPU kernels are off"
    if not bf16_gemm():
        return "float32", "oneDNN builds no bf16 GEMM on this CPU"
    if blocks:
        return "float32", "the weights are quantized blocks, whose kernels take fp32 activations"
    return "bfloat16", f"this CPU multiplies bf16 natively ({', '.join(native)})"
