"""Block weights held interleaved 16 rows at a time (layers/quant.py's *_x16 formats, read by
csrc/block_x16.h): the layout holds the same weights, and every kernel build this CPU runs
computes with them on every dot path, each row alike at any row count."""

from __future__ import annotations

import pytest
import torch

from everystop.executor.layers.cpu_kernels import CpuKernels, load_cpu_kernels, runnable_isas
from everystop.executor.layers.quant import (
    FORMATS,
    deinterleave,
    dequantize,
    format_code,
    interleave,
    quantize,
    rows_of,
)

N, K = 96, 320


@pytest.fixture(params=runnable_isas())
def kernels(request) -> CpuKernels:
    loaded = load_cpu_kernels(request.param)
    assert loaded is not None
    return loaded


def _weights(fmt: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(standard blocks, interleaved blocks) of one random [N, K] weight."""
    q = quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)), fmt)
    x16 = interleave(q)
    assert x16.fmt == fmt + "_x16" and x16.data.shape == q.data.shape
    return q.data, x16.data


def _q8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the integer paths see it: each 32-value block rounded to int8 steps of max / 127."""
    b = x.reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return ((b * inv).round() * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_interleaving_keeps_the_blocks(kernels, fmt):
    """Interleaving permutes bytes only: undone it gives the blocks back, and the kernels'
    dequantize of the interleaved weight (whole, or rows from any offset) equals the
    standard one."""
    std, x16 = _weights(fmt)
    assert not torch.equal(std, x16)
    assert torch.equal(deinterleave(x16, fmt + "_x16", K), std)
    want = kernels.dequantize(std, format_code(fmt), K)
    assert torch.equal(kernels.dequantize(x16, format_code(fmt + "_x16"), K), want)
    assert torch.equal(want, dequantize(std, fmt, K))
    rows = kernels.dequantize(x16.view(-1, 16 * x16.shape[1])[2:4].reshape(32, -1),
                              format_code(fmt + "_x16"), K)
    assert torch.equal(rows, want[32:64])  # groups looked up alone, as an embedding does


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rows_looked_up_in_an_interleaved_weight_are_the_files_rows(fmt):
    """An embedding held interleaved (its tied LM head takes the integer dots) looks its rows
    up byte-exact: any rows, repeated, across groups and within one."""
    std, x16 = _weights(fmt)
    ids = torch.tensor([0, 95, 17, 16, 15, 17, 40, 41, 3])
    assert torch.equal(rows_of(x16, fmt + "_x16", K, ids), std[ids])
    assert torch.equal(rows_of(std, fmt, K, ids), std[ids])


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows", [*range(1, 10), 40])
def test_interleaved_gemv_follows_a_float_reference(kernels, fmt, rows):
    """Every dot path on the interleaved weight against a plain matmul of the same weights
    (x rounded to int8 per block first on the integer paths); the fp32 path and the tiled
    GEMM give exactly what they give on the standard layout."""
    std, x16 = _weights(fmt, seed=rows)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(100 + rows))
    x[0, :32] = 0.0  # an all-zero block of x: scale 0
    code, code16 = format_code(fmt), format_code(fmt + "_x16")
    w = kernels.dequantize(std, code, K)
    for path in kernels.ops.int_dot_paths():
        out = kernels.ops.linear_q_small_path(x, x16, code16, K, path)
        xin = x if path == 0 else _q8_rows(x)
        torch.testing.assert_close(out, xin @ w.T, rtol=1e-4, atol=1e-4, msg=f"path {path}")
        if path == 0:
            assert torch.equal(out, kernels.ops.linear_q_small_path(x, std, code, K, 0))
    assert torch.equal(kernels.ops.linear_q_tiled(x, x16, code16, K),
                       kernels.ops.linear_q_tiled(x, std, code, K))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_interleaved_gemv_sums_a_row_alike_at_any_row_count_and_path(kernels, fmt):
    """Each row of a k-row call is bit-identical to that row alone (batch invariance with int8
    activations), over one pass (<= 8 rows) and the grouped passes (9, 17, 40); and, the
    integer sums being exact and the float steps the same per lane, every integer path of
    every build gives the same bits."""
    _, x16 = _weights(fmt, seed=5)
    code16 = format_code(fmt + "_x16")
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(6))
    paths = [p for p in kernels.ops.int_dot_paths() if p != 0]
    first = None
    for path in paths:
        alone = torch.cat([kernels.ops.linear_q_small_path(x[i:i + 1], x16, code16, K, path)
                           for i in range(len(x))])
        for rows in (2, 5, 8, 9, 17, 40):
            out = kernels.ops.linear_q_small_path(x[:rows], x16, code16, K, path)
            assert torch.equal(out, alone[:rows]), (path, rows)
        if first is None:
            first = alone
        assert torch.equal(alone, first), f"path {path} differs from path {paths[0]}"


def test_interleaved_gemv_is_the_same_on_every_build():
    """The AVX2 and AVX-512 builds' integer paths give the same bits on interleaved weights
    (one layout, one per-lane arithmetic, whatever the register width)."""
    builds = [load_cpu_kernels(isa) for isa in runnable_isas() if isa != "generic"]
    if len(builds) < 2:
        pytest.skip("one integer-dot build runs on this CPU")
    _, x16 = _weights("q4_1", seed=7)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(8))
    outs = [b.ops.linear_q_small_path(x, x16, format_code("q4_1_x16"), K, path)
            for b in builds if b is not None for path in b.ops.int_dot_paths() if path != 0]
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_interleaving_needs_whole_groups_of_16_rows():
    q = quantize(torch.randn(40, 64), "q4_0")
    with pytest.raises(ValueError, match="multiple of 16"):
        interleave(q)
