"""Qwen3-MoE: the shared decoder with per-head RMSNorms on queries and keys, and a sparse MoE
block (many experts, top-k of a softmax, renormalized only under `norm_topk_prob`, no shared
expert) in every layer but those `mlp_only_layers` / `decoder_sparse_step` leave dense.

llama.cpp's GGUF ("qwen3moe") always renormalizes the top-k weights (every released Qwen3-MoE
sets norm_topk_prob); `qwen3moe.expert_weights_norm`, where a file has it, says otherwise."""

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
from everystop.executor.models.moe_decoder import (
    MoeArgs,
    MoeForCausalLM,
    gguf_dense_layers,
    gguf_expert_names,
    moe_hf_sources,
)

_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj")


def _hf_args(config: dict[str, Any]) -> DecoderArgs:
    fields = hf_common_args(config)
    windows = (hf_layer_windows(config, fields["num_layers"])
               if config.get("use_sliding_window") else ())
    # transformers 5 writes num_local_experts; released checkpoints num_experts.
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    step = int(config.get("decoder_sparse_step", 1))
    only_mlp = set(config.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(fields["num_layers"])
                  if i in only_mlp or num_experts == 0 or (i + 1) % step)
    return MoeArgs(**fields, qk_norm=True, layer_windows=windows,
                   attention_bias=bool(config.get("attention_bias", False)),
                   num_experts=num_experts,
                   experts_per_token=int(config.get("num_experts_per_tok", 0)),
                   expert_intermediate_size=int(config.get("moe_intermediate_size", 0)),
                   norm_topk_prob=bool(config.get("norm_topk_prob", False)), dense_layers=dense)


def _gguf_args(meta: GGUFMeta) -> DecoderArgs:
    fields = gguf_common_args(meta)
    return MoeArgs(**fields, qk_norm=True, attention_bias="blk.0.attn_q.bias" in meta.tensors,
                   num_experts=int(meta.key("expert_count")),
                   experts_per_token=int(meta.key("expert_used_count")),
                   expert_intermediate_size=int(meta.key("expert_feed_forward_length")),
                   norm_topk_prob=bool(meta.key("expert_weights_norm", True)),
                   dense_layers=gguf_dense_layers(meta.tensors, fields["num_layers"]))


FAMILY = Family(name="qwen3_moe", hf_architectures=("Qwen3MoeForCausalLM",),
                hf_model_types=("qwen3_moe",), gguf_architectures=("qwen3moe",),
                hf_args=_hf_args, gguf_args=_gguf_args,
                gguf_layer_names={**gguf_expert_names(*_NAMES), "attn_q_norm": "self_attn.q_norm",
                                  "attn_k_norm": "self_attn.k_norm"},
                hf_sources=moe_hf_sources(*_NAMES), model_class=MoeForCausalLM,
                notes="q/k norm, experts")
