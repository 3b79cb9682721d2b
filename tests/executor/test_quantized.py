"""Weights held as GGUF blocks: the formats match the gguf package's reference, every kernel
build this CPU runs computes with exactly the weights the blocks hold, the loader keeps a
file's blocks byte for byte, and the default model held quantized follows fp32 (rates printed;
the full 32 x 64 measurement is `everystop bench quant-accuracy`)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from everystop.bench.quant_accuracy import measure, prompts
from everystop.executor.layers.cpu_kernels import CpuKernels, load_cpu_kernels, runnable_isas
from everystop.executor.layers.linear import HeldWeight, linear, onednn_bf16_gemm_supported
from everystop.executor.layers.quant import (
    DENSE,
    FORMATS,
    X16,
    deinterleave,
    dequantize,
    quantize,
)
from everystop.executor.models.loader import (
    default_model_path,
    load_model,
    round_as_held,
    weight_memory,
)

GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


@pytest.fixture(params=runnable_isas())
def kernels(request) -> CpuKernels:
    loaded = load_cpu_kernels(request.param)
    assert loaded is not None
    return loaded


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_blocks_match_the_gguf_reference(fmt):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    kind = GGMLQuantizationType[GGUF_TYPES[fmt]]
    theirs = torch.from_numpy(gguf_quantize(w.numpy(), kind))
    ours = quantize(w, fmt)
    # Equal bytes except where a value sits on a rounding tie (none expected on random data).
    assert (ours.data != theirs).float().mean() < 1e-3
    ref = torch.from_numpy(gguf_dequantize(theirs.numpy(), kind).astype(np.float32))
    torch.testing.assert_close(dequantize(theirs, fmt, 256), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_kernels_compute_with_the_held_weights(kernels, fmt, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 320, generator=g)  # 200: not a multiple of any column group
    q = quantize(w, fmt)
    x = torch.randn(rows, 320, generator=g)
    exact = x @ q.dequantize().T
    torch.testing.assert_close(kernels.dequantize(q.data, FORMATS[fmt][0], 320),
                               q.dequantize(), rtol=0, atol=0)
    torch.testing.assert_close(linear(x, q.data, None, fmt, 320), exact, rtol=1e-4, atol=1e-4)
    xb = x.bfloat16()
    # With int8_decode_dot x is rounded to int8 per block at every row count and the GEMV rows
    # take an integer dot path where the build has one
    # (test_every_decode_dot_path_computes_the_same_product checks each); by default every row
    # is widened to fp32.
    for k8 in (kernels, dataclasses.replace(kernels, int8_decode_dot=True)):
        int_decode = k8.int8_decode_dot
        seen = (_q8_rows(x) @ q.dequantize().T) if int_decode else exact
        torch.testing.assert_close(linear(x, q.data, k8, fmt, 320), seen, rtol=1e-4, atol=1e-4)
        seen_b = (_q8_rows(xb.float()) if int_decode else xb.float()) @ q.dequantize().T
        torch.testing.assert_close(linear(xb, q.data, k8, fmt, 320).float(), seen_b,
                                   rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_int8_activations_compute_a_row_alone_as_in_a_chunk(kernels, fmt):
    """With int8_decode_dot a token's product must not depend on how many rows share its
    call: decoded alone (integer dots), in a decode batch (fp32 on rounded x) or inside a
    prefill chunk (GEMM on rounded x) agree up to the order of fp32 sums. Otherwise a prompt
    whose prefix is cached (its last token then runs alone) answers differently from the
    same prompt computed whole."""
    g = torch.Generator().manual_seed(7)
    q = quantize(torch.randn(200, 320, generator=g), fmt)
    x = torch.randn(40, 320, generator=g)
    k8 = dataclasses.replace(kernels, int8_decode_dot=True)
    chunk = linear(x, q.data, k8, fmt, 320)
    for start, size in ((0, 1), (5, 1), (9, 3), (12, 8)):
        part = linear(x[start:start + size], q.data, k8, fmt, 320)
        torch.testing.assert_close(part, chunk[start:start + size], rtol=1e-5, atol=1e-4,
                                   msg=f"rows {start}:{start + size}")


def _q8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the integer decode paths see it: each 32-value block rounded to int8 steps of
    max|block| / 127 (fp32 scale)."""
    b = x.reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    # NOTE: 127 / amax as a true division, as the kernel computes it (torch's scalar / tensor
    # multiplies by the reciprocal instead, which rounds a bf16 input's ties differently).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (b * inv).round()
    return (q * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 8, 20])
def test_every_decode_dot_path_computes_the_same_product(kernels, fmt, rows):
    """Each dot path this build runs on this CPU (0: fp32 widening; 1: AVX2 maddubs; 2:
    AVX-VNNI; 3: AVX512-VNNI) against a plain matmul of the same weights: the integer paths
    with x rounded per block to int8 first, as they do."""
    g = torch.Generator().manual_seed(10 + rows)
    w = torch.randn(200, 320, generator=g)
    q = quantize(w, fmt)
    x = torch.randn(rows, 320, generator=g)
    x[0, :32] = 0.0  # an all-zero block of x: scale 0
    paths = list(kernels.ops.int_dot_paths())
    assert paths[0] == 0 and (kernels.isa == "generic" or 1 in paths), paths
    for path in paths:
        xin = x if path == 0 else _q8_rows(x)
        out = kernels.ops.linear_q_small_path(x, q.data, FORMATS[fmt][0], 320, path)
        torch.testing.assert_close(out, xin @ q.dequantize().T, rtol=1e-4, atol=1e-4,
                                   msg=f"path {path}")
    print(f"\n{kernels.isa}: dot paths {paths}")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_decode_dot_path_sums_a_row_alike_at_any_row_count(kernels, fmt):
    """On each dot path, each row of a k-row call is bit-identical to that row alone (what
    batch-invariant mode relies on with int8 activations): the row's blocks accumulate in the
    same order whatever rows and columns share the pass (17: two groups of 8 and one row)."""
    g = torch.Generator().manual_seed(3)
    q = quantize(torch.randn(200, 320, generator=g), fmt)
    x = torch.randn(17, 320, generator=g)
    for path in kernels.ops.int_dot_paths():
        alone = torch.cat([kernels.ops.linear_q_small_path(x[i:i + 1], q.data,
                                                           FORMATS[fmt][0], 320, path)
                           for i in range(len(x))])
        for rows in (2, 5, 8, 9, 17):
            out = kernels.ops.linear_q_small_path(x[:rows], q.data, FORMATS[fmt][0], 320, path)
            assert torch.equal(out, alone[:rows]), (path, rows)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_weights_serve_fp32_activations_without_an_fp32_copy(kernels, dtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=g).to(dtype)
    x = torch.randn(33, 64, generator=g)
    torch.testing.assert_close(linear(x, w, kernels), x @ w.float().T, rtol=1e-4, atol=1e-4)
    assert not hasattr(w, "_everystop_packed")


def test_gguf_blocks_are_held_as_the_file_stores_them(default_runner):
    from gguf import GGUFReader

    model = default_runner.model  # ModelConfig's default: quantization="auto"
    reader = GGUFReader(default_model_path())
    file = {t.name: t for t in reader.tensors}
    down = model.model.layers[3].mlp.down_proj
    # The file's blocks, byte for byte (fp32 activations by default: no interleaving).
    assert down.weight_format == "q4_1"
    assert torch.equal(down.weight, torch.from_numpy(np.array(file["blk.3.ffn_down.weight"].data)))
    embed = model.model.embed_tokens
    assert embed.weight_format == "q8_0"  # the file's embedding (tied head) type
    nbytes, params = weight_memory(model)
    assert 0.6 < nbytes / params < 0.8, nbytes / params  # Q4_1 (5 bits) + a Q8_0 embedding
    print(f"\ndefault GGUF held as-is: {nbytes / params:.3f} bytes/param")


@pytest.mark.parametrize("int8", [True, False])
def test_block_weights_are_interleaved_only_for_the_integer_dots(kernels, int8):
    """Held for the kernels, block weights are interleaved 16 rows at a time (a permutation of
    the file's bytes) where the kernels take int8 activations, whose GEMV reads that layout;
    with fp32 activations they stay as the file stores them."""
    w = quantize(torch.randn(48, 64, generator=torch.Generator().manual_seed(3)), "q4_1")
    held = HeldWeight()
    held.kernels = dataclasses.replace(kernels, int8_decode_dot=int8)
    held.hold(w)
    assert held.weight_format == ("q4_1_x16" if int8 else "q4_1")
    assert torch.equal(deinterleave(held.weight, held.weight_format, held.weight_cols)
                       if int8 else held.weight, w.data)


def test_quantized_model_follows_fp32():
    """A small sample (CI time: 4 prompts decoded together; one at a time, through the
    integer-dot GEMV, gave the same rates and took 4x longer), against fp32 and against the
    same model run in bf16, the floor of this model's own sensitivity. NOTE: the issue's bounds
    (Q8_0 top-1 >= 99%, Q4 >= 95%) are NOT met, and are out of reach on this reference: the
    default model ships only as Q4_1, so "fp32" is those values and Q8_0/Q4_0 round them a
    second time; its logits have many near ties, so even bf16 agrees on only ~98%
    (`everystop bench quant-accuracy`, 16 x 32: bf16 0.979, Q8_0 0.982). Guarded: Q8_0 follows
    fp32 about as well as bf16 does (two tokens of the sample's slack), and both 8- and 4-bit
    stay at their measured level, far above a wrong kernel (~0)"""
    variants = {"bf16": {"quantization": "none", "dtype": "bfloat16"},
                "bf16-held": {"quantization": "bf16", "dtype": "float32"},
                "q8_0": {"quantization": "q8_0"}, "q4_0": {"quantization": "q4_0"}}
    result = measure(variants, prompts(4), 24, batch=4)
    for name in variants:
        print(f"\n{name}: greedy equal {result[name]['greedy_equal']:.2f}, "
              f"top-1 {result[name]['top1_agreement']:.3f}, "
              f"{result[name]['bytes_per_param']} B/param")
    q8, bf16 = result["q8_0"]["top1_agreement"], result["bf16"]["top1_agreement"]
    assert q8 >= bf16 - 2 / 96 and q8 >= 0.95
    # bf16 weights beside fp32 activations round less than bf16 throughout
    assert result["bf16-held"]["top1_agreement"] >= bf16 - 2 / 96
    assert 1.9 < result["bf16-held"]["bytes_per_param"] < 2.1
    assert result["q4_0"]["top1_agreement"] >= 0.70
    assert result["q8_0"]["bytes_per_param"] < 1.1 and result["q4_0"]["bytes_per_param"] < 0.8


@pytest.fixture(scope="module")
def fp32_model() -> torch.nn.Module:
    return load_model(quantization="none")


@pytest.mark.model
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_rounding_variant_holds_exactly_the_real_variants_values(fp32_model, fmt):
    """`bench quant-accuracy`'s `{fmt}_rounding` (round_as_held on the fp32 model) separates
    the format's rounding from the block kernels only if its weights are, bit for bit, what
    the `fmt` variant holds dequantized: every matrix that variant holds as blocks (the
    embedding as the file's own Q8_0 blocks), and nothing else changed."""
    real = load_model(quantization=fmt)
    rounded = copy.deepcopy(fp32_model)
    fp32 = dict(fp32_model.named_parameters())
    changed = round_as_held(rounded, fmt)
    blocks = {f"{n}.weight": m for n, m in real.named_modules()
              if isinstance(m, HeldWeight) and m.weight_format != DENSE}
    assert changed == len(blocks) > 0
    assert blocks["model.embed_tokens.weight"].weight_format.removesuffix(X16) == "q8_0"
    for name, w in rounded.named_parameters():
        if name in blocks:
            m = blocks[name]
            held = dequantize(m.weight, m.weight_format, m.weight_cols)
            assert torch.equal(w, held), name
            # The file's embedding is Q8_0 already (rounding it again is idempotent); every
            # Q4_1 projection does change.
            if name != "model.embed_tokens.weight":
                assert not torch.equal(w, fp32[name]), name
        else:
            assert torch.equal(w, fp32[name]), name


def test_metrics_expose_rss_and_weight_bytes():
    from types import SimpleNamespace

    from everystop.engine.engine_state import EngineMemory
    from everystop.server.metrics import _memory_metrics

    front = SimpleNamespace(memory=lambda: EngineMemory(weight_bytes=1234))
    gauges = {m.name: m.samples[0].value for m in _memory_metrics(front)}  # type: ignore[arg-type]
    assert gauges["everystop:model_weight_bytes"] == 1234
    assert gauges["everystop:process_resident_memory_bytes"] > 10 << 20


@pytest.mark.parametrize("fmt", ["dense", "q8_0"])
def test_large_weights_are_widened_tile_by_tile(kernels, fmt):
    # Over 16 MiB as fp32 (csrc/quant_linear.cpp kWholeWidenBytes): this weight takes the
    # tile-by-tile path, the small ones above are widened whole; both must give the product.
    g = torch.Generator().manual_seed(3)
    w = torch.randn(7000, 640, generator=g)  # 7000: not a multiple of any tile
    x = torch.randn(40, 640, generator=g)
    if fmt == "dense":
        held, code, exact_w = w.bfloat16(), 0, w.bfloat16().float()
    else:
        q = quantize(w, fmt)
        held, code, exact_w = q.data, FORMATS[fmt][0], q.dequantize()
    assert 7000 * 640 * 4 > 16 << 20
    torch.testing.assert_close(kernels.linear_q_tiled(x, held, code, 640), x @ exact_w.T,
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows", [12, 40])  # 12: tile by tile; 40: the weight widened whole
def test_bf16_tiles_multiply_the_held_weights_rounded_to_bf16(kernels, fmt, rows):
    # Where bf16 GEMMs were timed faster (fp32_gemm_for_16bit False), block weights meeting a
    # bf16 x are dequantized into bf16 tiles for a bf16 GEMM: the product of x with the held
    # weights each rounded to bf16, as a bf16 model's linear computes it.
    if not onednn_bf16_gemm_supported():
        # select_backends refuses the native path on such a CPU (tested in test_fused_ops.py).
        pytest.skip("this CPU's oneDNN has no bf16 GEMM (AVX2-only): the bf16 tiles cannot run")
    g = torch.Generator().manual_seed(rows)
    q = quantize(torch.randn(200, 320, generator=g), fmt)
    x = torch.randn(rows, 320, generator=g).bfloat16()
    code = FORMATS[fmt][0]
    native = dataclasses.replace(kernels, fp32_gemm_for_16bit=False)
    out = native.linear_q_tiled(x, q.data, code, 320)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.nn.functional.linear(x, q.dequantize().bfloat16()),
                               rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, native.ops.linear_q_tiled_bf16(x, q.data, code, 320),
                               rtol=0, atol=0)
    # The fp32 tiles (the default, and every AVX2-only CPU) are what the bf16 tiles replace.
    fp32_tiles = kernels.linear_q_tiled(x, q.data, code, 320)
    torch.testing.assert_close(fp32_tiles, (x.float() @ q.dequantize().T).bfloat16(),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows", [9, 21, 32, 64])
def test_block_gemv_takes_decode_batches_8_rows_at_a_time(kernels, fmt, rows):
    # A decode batch of 9-32 rows stays on the GEMV (linear() routes it there; 64 is the op's
    # limit); 4096 columns make the ~256 KiB column groups fewer columns than the weight's 200.
    g = torch.Generator().manual_seed(rows)
    q = quantize(torch.randn(200, 4096, generator=g), fmt)
    x = torch.randn(rows, 4096, generator=g)
    exact = x @ q.dequantize().T
    out = (linear(x, q.data, kernels, fmt, 4096) if rows <= 32 else
           kernels.ops.linear_q_small_path(x, q.data, FORMATS[fmt][0], 4096, 0))
    torch.testing.assert_close(out, exact, rtol=1e-4, atol=1e-3)
