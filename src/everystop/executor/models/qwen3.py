"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before rope, and no
q/k/v biases unless the config asks for them."""

from __future__ import annotations

from typing import Any

from everystop.executor.models.decoder import DecoderArgs
from everystop.executor.models.family import (
    Family,
    GGUFMeta,
    gguf_common_args,
    hf_common_args,
    hf_layer_windows,
)


def _hf_args(config: dict[str, Any]) -> DecoderArgs:
    fields = hf_common_args(config)
    windows = (hf_layer_windows(config, fields["num_layers"])
               if config.get("use_sliding_window") else ())
    return DecoderArgs(**fields, qk_norm=True, layer_windows=windows,
                       attention_bias=bool(config.get("attention_bias", False)))


def _gguf_args(meta: GGUFMeta) -> DecoderArgs:
    return DecoderArgs(**gguf_common_args(meta), qk_norm=True,
                       attention_bias="blk.0.attn_q.bias" in meta.tensors)


FAMILY = Family(name="qwen3", hf_architectures=("Qwen3ForCausalLM",),
                hf_model_types=("qwen3",), gguf_architectures=("qwen3",),
                hf_args=_hf_args, gguf_args=_gguf_args,
                gguf_layer_names={"attn_q_norm": "self_attn.q_norm",
                                  "attn_k_norm": "self_attn.k_norm"},
                notes="q/k norm")
