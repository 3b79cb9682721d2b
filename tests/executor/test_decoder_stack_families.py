"""The decoder stack with the families' differences as parameters (q/k/v bias, q/k norm,
sliding windows shorter than the contexts, score soft-cap, Gemma's sandwich norms, GeGLU and
local layers' own rope base) against the layer-by-layer path: bit-identical hidden states and
KV caches, as for Llama (test_decoder_stack.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from everystop.executor.layers.cpu_kernels import load_cpu_kernels, runnable_isas
from everystop.executor.layers.quant import quantize
from everystop.executor.models.decoder import Backends, DecoderArgs, DecoderForCausalLM
from everystop.executor.models.moe_decoder import MoeArgs, MoeForCausalLM

from .test_decoder_stack import ARGS, _assert_bit_identical

# Windows of 8 tokens (two blocks of 4) under contexts of up to 43 tokens; one layer global.
VARIANTS = {
    "qwen2": dict(attention_bias=True),
    "qwen3": dict(qk_norm=True),
    "mistral": dict(layer_windows=(8, 8, 8)),
    "capped": dict(attn_softcap=1.5, layer_windows=(8, 0, 5)),
    "all": dict(attention_bias=True, qk_norm=True, layer_windows=(0, 8, 8), attn_softcap=3.0),
    "gemma2": dict(sandwich_norms=True, hidden_act="gelu_tanh", layer_windows=(8, 0, 8),
                   attn_softcap=2.0, attn_scale=0.1),
    "gemma3": dict(sandwich_norms=True, hidden_act="gelu_tanh", qk_norm=True,
                   layer_windows=(8, 8, 0), rope_theta=1e6, local_rope_theta=1e4),
}


def _model(args: DecoderArgs, backends: Backends, dtype: torch.dtype) -> DecoderForCausalLM:
    torch.manual_seed(0)
    model = DecoderForCausalLM(args, backends=backends)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "bias" not in name:  # norms
            torch.nn.init.uniform_(p, 0.5, 1.5)
        else:
            torch.nn.init.normal_(p, 0.0, 0.2)
    return model.to(dtype)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_family_stack_is_bit_identical_to_the_layers(variant, dtype, cache_dtype):
    args = dataclasses.replace(ARGS, **VARIANTS[variant])
    kernels = load_cpu_kernels(runnable_isas()[0])
    stacked = _model(args, Backends(kernels, "auto", decoder_stack=True), dtype)
    layered = _model(args, Backends(kernels, "auto", decoder_stack=False), dtype)
    assert stacked.stack_ready
    _assert_bit_identical(stacked, layered, dtype, cache_dtype)


# Experts: 6 of intermediate size 64, 2 or 3 per token (renormalized, as Mixtral, or not, as
# Qwen3-MoE may).
MOE_VARIANTS = {
    "mixtral": dict(num_experts=6, experts_per_token=2, expert_intermediate_size=64,
                    norm_topk_prob=True, layer_windows=(8, 8, 8)),
    "qwen3_moe": dict(num_experts=6, experts_per_token=3, expert_intermediate_size=64,
                      norm_topk_prob=False, qk_norm=True),
    "one_dense_layer": dict(num_experts=6, experts_per_token=2, expert_intermediate_size=64,
                            dense_layers=(1,)),
}


def _moe_model(args: MoeArgs, backends: Backends, dtype: torch.dtype,
               fmt: str | None = None) -> MoeForCausalLM:
    torch.manual_seed(0)
    model = MoeForCausalLM(args, backends=backends)
    for p in model.parameters():
        if p.dim() == 1:  # norms
            torch.nn.init.uniform_(p, 0.5, 1.5)
        else:
            torch.nn.init.normal_(p, 0.0, 0.2)
    model = model.to(dtype)
    if fmt is not None:  # every projection, the experts included, as GGUF blocks
        for layer in model.model.layers:
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                      *model._stack_mlp(layer)):
                m.hold(quantize(m.weight.data, fmt))
    return model


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_stack_is_bit_identical_to_the_layers(variant, dtype):
    """Mixture-of-experts layers run inside the stack (the router, top-k and the chosen
    experts in C++): the same hidden states, caches and weight bytes as layer by layer."""
    args = MoeArgs(**{**dataclasses.asdict(ARGS), **MOE_VARIANTS[variant]})
    kernels = load_cpu_kernels(runnable_isas()[0])
    stacked = _moe_model(args, Backends(kernels, "auto", decoder_stack=True), dtype)
    layered = _moe_model(args, Backends(kernels, "auto", decoder_stack=False), dtype)
    assert stacked.stack_ready
    _assert_bit_identical(stacked, layered, dtype, dtype)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("int8_dot", [False, True])
def test_moe_stack_with_block_experts_is_bit_identical_to_the_layers(fmt, int8_dot):
    args = MoeArgs(**{**dataclasses.asdict(ARGS), **MOE_VARIANTS["qwen3_moe"]})
    kernels = dataclasses.replace(load_cpu_kernels(runnable_isas()[0]), int8_decode_dot=int8_dot)
    stacked = _moe_model(args, Backends(kernels, "auto", decoder_stack=True), torch.float32, fmt)
    layered = _moe_model(args, Backends(kernels, "auto", decoder_stack=False), torch.float32,
                         fmt)
    _assert_bit_identical(stacked, layered, torch.float32, torch.bfloat16)
