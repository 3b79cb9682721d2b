"""The decoder stack with the families' differences as parameters (q/k/v bias, q/k norm,
sliding windows shorter than the contexts, score soft-cap, Gemma's sandwich norms, GeGLU and
local layers' own rope base) against the layer-by-layer path: bit-identical hidden states and
KV caches, as for Llama (test_decoder_stack.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from everystop.executor.layers.cpu_kernels import load_cpu_kernels, runnable_isas
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


def test_what_the_stack_lacks_keeps_the_layers():
    moe = MoeArgs(**dataclasses.asdict(ARGS), num_experts=4, experts_per_token=2,
                  expert_intermediate_size=32)
    model = MoeForCausalLM(moe)
    assert not model.stack_ready
    assert moe.stack_blockers() == ["experts"]
