"""The one-call decoder stack (csrc/decoder_stack.cpp) against the layer-by-layer module path:
the same kernels in the same order, so the hidden states and the KV caches it writes must be
bit-identical, for every kernel build this CPU runs, every activation and cache dtype, and
batches from 1 to 8 rows, and up to 32 where every linear takes the GEMV that far (16-bit
weights beside fp32 activations, block weights) (decodes and a short prefill chunk over a
cached prefix)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from everystop.core.outputs import ScheduledSequence
from everystop.executor.inputs import build_inputs
from everystop.executor.kv_pool import KVPool
from everystop.executor.layers.cpu_kernels import load_cpu_kernels, runnable_isas
from everystop.executor.layers.linear import CHUNKED_GEMV_ROWS, SMALL_ROWS
from everystop.executor.layers.quant import quantize
from everystop.executor.models.decoder import Backends, DecoderArgs, DecoderForCausalLM
from everystop.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
# head_dim 64 takes the attention kernel's fixed-size path on both vector widths; 3 layers
# with 6 heads over 2 kv heads (GQA).
ARGS = DecoderArgs(vocab_size=320, hidden_size=96, intermediate_size=160, num_layers=3,
                   num_heads=6, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5)
BLOCK = 4


def _model(backends: Backends, dtype: torch.dtype) -> DecoderForCausalLM:
    torch.manual_seed(0)
    model = DecoderForCausalLM(ARGS, backends=backends)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            torch.nn.init.uniform_(p, 0.5, 1.5)
        else:
            torch.nn.init.normal_(p, 0.0, 0.2)
    return model.to(dtype)


def _batch(rows: int, seed: int) -> list[ScheduledSequence]:
    """`rows` query tokens: single decodes over random contexts, and (rows >= 3) one sequence
    with a 3-token chunk over a cached prefix."""
    rng = random.Random(seed)
    seqs, next_block, left = [], 0, rows
    while left:
        qlen = 3 if left >= 3 and not seqs and rows >= 3 else 1
        context = rng.randint(1, 40)
        blocks = list(range(next_block, next_block + (context + qlen + BLOCK - 1) // BLOCK))
        next_block += len(blocks)
        seqs.append(ScheduledSequence(f"s{len(seqs)}", [rng.randrange(ARGS.vocab_size)
                                                        for _ in range(qlen)],
                                      context, blocks, True, GREEDY))
        left -= qlen
    return seqs


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_stack_is_bit_identical_to_the_layers(isa, dtype, cache_dtype):
    kernels = load_cpu_kernels(isa)
    stacked = _model(Backends(kernels, "auto", decoder_stack=True), dtype)
    layered = _model(Backends(kernels, "auto", decoder_stack=False), dtype)
    _assert_bit_identical(stacked, layered, dtype, cache_dtype)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("int8_dot", [False, True])
def test_stack_with_block_weights_is_bit_identical_to_the_layers(isa, fmt, int8_dot):
    """GGUF-style block weights (the default model's Q4_1) take the same block GEMV in the
    stack as in the layers, with int8 activations (int8_decode_dot) too."""
    kernels = dataclasses.replace(load_cpu_kernels(isa), int8_decode_dot=int8_dot)
    models = []
    for stack in (True, False):
        model = _model(Backends(kernels, "auto", decoder_stack=stack), torch.float32)
        for layer in model.model.layers:
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                      layer.mlp.down_proj):
                m.hold(quantize(m.weight.data, fmt))
        models.append(model)
    _assert_bit_identical(models[0], models[1], torch.float32, torch.bfloat16)


def _assert_bit_identical(stacked: DecoderForCausalLM, layered: DecoderForCausalLM,
                          dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    assert stacked._stack_weights() is not None
    # fp32 weights leave the GEMV after 8 rows (for the fp32 GEMM); 16-bit weights (with the
    # kernels' default fp32 GEMM for them) and block weights keep it up to 32.
    limit = stacked._stack_rows(dtype)
    down = stacked._stack_mlp(stacked.model.layers[0])[1].weight
    assert limit == (SMALL_ROWS if down.dtype == torch.float32 else CHUNKED_GEMV_ROWS)
    for rows in [*range(1, SMALL_ROWS + 1), 9, 13, 21, 32]:
        seqs = _batch(rows, seed=rows)
        inputs = build_inputs(seqs, BLOCK, torch.device("cpu"))
        num_blocks = max(b for s in seqs for b in s.block_ids) + 1
        pools = []
        for _ in (stacked, layered):
            pool = KVPool(ARGS.num_layers, ARGS.num_kv_heads, ARGS.head_dim, BLOCK, num_blocks,
                          0, cache_dtype, torch.device("cpu"))
            gen = torch.Generator().manual_seed(rows)
            for k, v in pool.kv_caches:  # the cached prefix: the same random K/V in both
                k.copy_(torch.randn(k.shape, generator=gen))
                v.copy_(torch.randn(v.shape, generator=gen))
            pools.append(pool)
        assert stacked._runs_decoder_stack(  # the fast path is really taken (up to the limit)
            stacked.model.embed_tokens(inputs.input_ids), pools[0].kv_caches, inputs.meta
        ) == (rows <= limit)
        out_stack = stacked(inputs.input_ids, inputs.positions, pools[0].kv_caches, inputs.meta)
        out_layers = layered(inputs.input_ids, inputs.positions, pools[1].kv_caches, inputs.meta)
        assert out_stack.dtype == dtype and torch.isfinite(out_stack.float()).all()
        assert torch.equal(out_stack, out_layers), f"{rows} rows"
        for (k1, v1), (k2, v2) in zip(pools[0].kv_caches, pools[1].kv_caches, strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert stacked.weight_bytes_last_pass() == layered.weight_bytes_last_pass()


def test_larger_batches_and_torch_attention_take_the_layers():
    kernels = load_cpu_kernels(runnable_isas()[0])
    model = _model(Backends(kernels, "auto"), torch.float32)
    torch_attention = _model(Backends(kernels, "torch"), torch.float32)
    seqs = _batch(SMALL_ROWS + 1, seed=0)
    small = _batch(2, seed=1)
    pool = KVPool(ARGS.num_layers, ARGS.num_kv_heads, ARGS.head_dim, BLOCK, 64, 0,
                  torch.float32, torch.device("cpu"))
    big_in = build_inputs(seqs, BLOCK, torch.device("cpu"))
    small_in = build_inputs(small, BLOCK, torch.device("cpu"))
    x_big = model.model.embed_tokens(big_in.input_ids)
    x_small = model.model.embed_tokens(small_in.input_ids)
    assert not model._runs_decoder_stack(x_big, pool.kv_caches, big_in.meta)
    assert model._runs_decoder_stack(x_small, pool.kv_caches, small_in.meta)
    assert not torch_attention._runs_decoder_stack(x_small, pool.kv_caches, small_in.meta)
