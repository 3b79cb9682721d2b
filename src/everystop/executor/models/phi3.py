"""Phi-3 / Phi-3.5: the Llama decoder whose checkpoints already hold the fused projections
(`qkv_proj`, `gate_up_proj`: the decoder's own names), a sliding window on every layer where
the config sets one, LongRoPE scaling (layers/rotary.py). Partial rotary is refused, and so is
LongRoPE in a GGUF file (its factors as rope_factors_* tensors are not read)."""

from __future__ import annotations

from typing import Any

from everystop.executor.models.decoder import DecoderArgs, hf_sources
from everystop.executor.models.errors import ModelLoadError
from everystop.executor.models.family import (
    Family,
    GGUFMeta,
    gguf_common_args,
    gguf_layer_windows,
    hf_common_args,
    hf_layer_windows,
)


def _phi3_sources(args: DecoderArgs) -> dict[str, list[str]]:
    return {name: [name] for name in hf_sources(args)}  # already fused, already our names


def _hf_args(config: dict[str, Any]) -> DecoderArgs:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"unsupported partial_rotary_factor {partial} (only 1.0)")
    fields = hf_common_args(config)
    windows = hf_layer_windows(config, fields["num_layers"], default_all=True)
    return DecoderArgs(**fields, layer_windows=windows)


def _gguf_args(meta: GGUFMeta) -> DecoderArgs:
    if "rope_factors_long.weight" in meta.tensors:
        raise ModelLoadError(f"{meta.path}: unsupported rope scaling 'longrope' "
                             "(rope_factors_long)")
    fields = gguf_common_args(meta)
    return DecoderArgs(**fields, layer_windows=gguf_layer_windows(meta, fields["num_layers"]))


FAMILY = Family(name="phi3", hf_architectures=("Phi3ForCausalLM",),
                hf_model_types=("phi3",), gguf_architectures=("phi3",),
                hf_args=_hf_args, gguf_args=_gguf_args, hf_sources=_phi3_sources,
                gguf_layer_names={"attn_qkv": "self_attn.qkv_proj",
                                  "ffn_up": "mlp.gate_up_proj"},
                notes="fused qkv and gate_up checkpoints, LongRoPE")
