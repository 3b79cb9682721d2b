"""Mixtral: the shared decoder with a sparse MoE block in every layer (E experts, top-k chosen
by softmax then renormalized over the k). llama.cpp exports it as GGUF architecture "llama"
with `llama.expert_count` set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from everystop.executor.models.decoder import DecoderArgs
from everystop.executor.models.family import (
    Family,
    GGUFMeta,
    gguf_common_args,
    gguf_layer_windows,
    hf_common_args,
    hf_layer_windows,
)
from everystop.executor.models.moe_decoder import (
    MoeArgs,
    MoeForCausalLM,
    gguf_expert_names,
    moe_hf_sources,
)

# The block's module and its experts' gate, up and down projections, as Mixtral names them.
_NAMES = ("block_sparse_moe", "w1", "w3", "w2")


def _hf_args(config: dict[str, Any]) -> DecoderArgs:
    fields = hf_common_args(config)
    windows = hf_layer_windows(config, fields["num_layers"], default_all=True)  # as Mistral
    return MoeArgs(**fields, layer_windows=windows,
                   num_experts=int(config.get("num_local_experts", 0)),
                   experts_per_token=int(config.get("num_experts_per_tok", 0)),
                   expert_intermediate_size=fields["intermediate_size"], norm_topk_prob=True)


def _gguf_args(meta: GGUFMeta) -> DecoderArgs:
    fields = gguf_common_args(meta)
    return MoeArgs(**fields, layer_windows=gguf_layer_windows(meta, fields["num_layers"]),
                   num_experts=int(meta.key("expert_count")),
                   experts_per_token=int(meta.key("expert_used_count")),
                   expert_intermediate_size=fields["intermediate_size"], norm_topk_prob=True)


def is_mixtral_gguf(fields: Mapping[str, Any]) -> bool:
    """A "llama" GGUF file with experts is a Mixtral."""
    return int(fields.get("llama.expert_count") or 0) > 0


FAMILY = Family(name="mixtral", hf_architectures=("MixtralForCausalLM",),
                hf_model_types=("mixtral",), gguf_architectures=("llama",),
                hf_args=_hf_args, gguf_args=_gguf_args,
                gguf_layer_names=gguf_expert_names(*_NAMES), hf_sources=moe_hf_sources(*_NAMES),
                model_class=MoeForCausalLM, gguf_permuted_qk=True,
                gguf_accepts=is_mixtral_gguf, notes="sliding window, experts")
