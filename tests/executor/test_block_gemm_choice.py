"""`--cpu-16bit-gemm` for block weights: fp32 tiles under auto on any CPU (patched both ways),
bf16 tiles under native where oneDNN builds a bf16 GEMM; the choice is logged with its reason; the
bf16 route computes the held weights' product within bf16 rounding, leaves the GEMV rows and
the LM head alone, and a model under it still follows transformers."""

from __future__ import annotations

import dataclasses
import functools
import logging

import pytest
import torch

from everystop.config import ConfigError, ModelConfig
from everystop.executor import model_runner
from everystop.executor.block_gemm_choice import choose_block_gemm_bf16
from everystop.executor.layers.cpu_kernels import CpuKernels, load_cpu_kernels
from everystop.executor.layers.linear import (
    CHUNKED_GEMV_ROWS,
    gemv_rows,
    linear,
    onednn_bf16_gemm_supported,
)
from everystop.executor.layers.quant import FORMATS, quantize

KERNELS = CpuKernels(isa="avx512bf16")  # never called: the probes stand in for the CPU
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})
AVX512_NO_BF16 = frozenset({"avx2", "avx512f", "avx512_vnni"})


def _choose(flags: frozenset[str] = ZEN4, bf16_gemm: bool = True, blocks: bool = True,
            kernels: CpuKernels | None = KERNELS, **config: object) -> bool:
    return choose_block_gemm_bf16(ModelConfig(**config), kernels,  # type: ignore[arg-type]
                                  blocks, flags=lambda: flags, bf16_gemm=lambda: bf16_gemm)[0]


def test_auto_keeps_fp32_tiles_and_native_opts_in() -> None:
    # A row must compute alike whatever shares its pass (the GEMV multiplies in fp32).
    assert not _choose()
    assert not _choose(flags=frozenset({"avx2", "amx_bf16"}))
    assert not _choose(flags=AVX512_NO_BF16)  # bf16 emulated: ~0.5x the fp32 GEMM
    assert not _choose(flags=frozenset({"avx2", "fma"}), bf16_gemm=False)  # AVX2-only
    assert not _choose(bf16_gemm=False)  # a oneDNN without the primitive
    assert not _choose(blocks=False)  # float weights: the 16-bit rule (cpu_16bit_gemm) applies
    assert not _choose(kernels=None)  # plain torch
    assert not _choose(batch_invariant=True)  # every row count on the GEMV


def test_explicit_settings_override_auto() -> None:
    for flags in (ZEN4, AVX512_NO_BF16):
        assert not _choose(flags=flags, cpu_16bit_gemm="fp32")
        assert _choose(flags=flags, cpu_16bit_gemm="native")
    assert not _choose(blocks=False, cpu_16bit_gemm="native")
    with pytest.raises(ConfigError, match=r"cpu_16bit_gemm 'native'.*no bfloat16 GEMM"):
        _choose(bf16_gemm=False, cpu_16bit_gemm="native")


@pytest.mark.parametrize(("flags", "gains"), [(ZEN4, True), (AVX512_NO_BF16, False)])
def test_backends_keep_fp32_and_log_where_bf16_would_pay(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        flags: frozenset[str], gains: bool) -> None:
    """The default (bundled Q4_1) model with fp32 activations: fp32 tiles on either CPU
    (patched both ways), the choice logged once at start-up with a reason that says whether
    native would pay."""
    monkeypatch.setattr(model_runner, "choose_block_gemm_bf16", functools.partial(
        choose_block_gemm_bf16, flags=lambda: flags, bf16_gemm=lambda: True))
    with caplog.at_level(logging.INFO, logger="everystop.executor.model_runner"):
        backends = model_runner.select_backends(
            ModelConfig(dtype="float32", int8_decode_dot="off"), blocks=True)
    assert backends.kernels is not None
    assert not backends.kernels.block_gemm_bf16
    lines = [r.getMessage() for r in caplog.records if "block-weight GEMM auto" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("block-weight GEMM auto: fp32 (")
    reason = "multiplies bf16 natively (avx512_bf16)" if gains else "no native bf16"
    assert reason in lines[0], lines[0]


needs_bf16_gemm = pytest.mark.skipif(
    not onednn_bf16_gemm_supported(),
    reason="this CPU's oneDNN has no bf16 GEMM (AVX2-only): auto never picks the bf16 tiles")


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    loaded = load_cpu_kernels("auto")
    assert loaded is not None
    return loaded


@needs_bf16_gemm
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows", [CHUNKED_GEMV_ROWS + 1, 300])
def test_bf16_route_multiplies_the_held_weights_within_bf16_rounding(
        kernels: CpuKernels, fmt: str, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    q = quantize(torch.randn(200, 320, generator=g) * 0.05, fmt)
    x = torch.randn(rows, 320, generator=g)
    bf16 = dataclasses.replace(kernels, block_gemm_bf16=True)
    fp32 = dataclasses.replace(kernels, block_gemm_bf16=False)
    out = linear(x, q.data, bf16, fmt, 320)
    exact = x @ q.dequantize().T
    assert out.dtype == torch.float32
    # The product of x and the weights each rounded to bf16, the output rounded once more.
    ref = (x.bfloat16().float() @ q.dequantize().bfloat16().float().T).bfloat16().float()
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-3)
    error = float((out - exact).norm() / exact.norm())
    assert 1e-4 < error < 1e-2, error  # rounded (the route was taken), and only by bf16
    torch.testing.assert_close(linear(x, q.data, fp32, fmt, 320), exact, rtol=1e-4, atol=1e-4)


@needs_bf16_gemm
def test_gemv_rows_and_the_lm_head_keep_fp32(kernels: CpuKernels) -> None:
    """Decode-sized passes stay on the GEMV (bit-identical with or without the bf16 route) and
    the vocabulary projection, the most sensitive product, keeps the fp32 tiles."""
    bf16 = dataclasses.replace(kernels, block_gemm_bf16=True)
    q = quantize(torch.randn(200, 320) * 0.05, "q4_1")
    assert gemv_rows(q.data, "q4_1", torch.float32, bf16) == CHUNKED_GEMV_ROWS
    x = torch.randn(CHUNKED_GEMV_ROWS, 320)
    assert torch.equal(linear(x, q.data, bf16, "q4_1", 320),
                       linear(x, q.data, kernels, "q4_1", 320))
    assert not bf16.fp32_activations.block_gemm_bf16


def test_the_kernels_flags_are_given_by_name() -> None:
    # A flag inserted among the others must not shift a positional call into the wrong flags.
    with pytest.raises(TypeError):
        CpuKernels("avx512bf16", True)  # type: ignore[misc]
