"""Gemma 2: GeGLU (tanh GELU), RMSNorms scaling by (1 + w), a norm on the attention's and the
MLP's outputs too, embeddings scaled by sqrt(hidden), soft-capped attention scores and logits,
the score scale from `query_pre_attn_scalar`, and sliding windows on alternate layers.

Checkpoint names: Gemma's `pre_feedforward_layernorm` is the decoder's pre-MLP norm
(`post_attention_layernorm`), and Gemma's `post_attention_layernorm` /
`post_feedforward_layernorm` are its `attn_out_norm` / `mlp_out_norm`."""

from __future__ import annotations

import math
from typing import Any

from everystop.executor.models.decoder import DecoderArgs, hf_sources
from everystop.executor.models.errors import ModelLoadError
from everystop.executor.models.family import (
    Family,
    GGUFMeta,
    gguf_common_args,
    hf_common_args,
    hf_layer_windows,
)

# GGUF layer tensors of Gemma 2/3 that differ from the shared names (llama.cpp's export).
GEMMA_GGUF_NAMES = {"ffn_norm": "pre_feedforward_layernorm",
                    "post_attention_norm": "post_attention_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm",
                    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def gemma_hf_sources(args: DecoderArgs) -> dict[str, list[str]]:
    """The shared sources with Gemma's norm names (see the module docstring)."""
    out = hf_sources(args)
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        out[p + "post_attention_layernorm.weight"] = [p + "pre_feedforward_layernorm.weight"]
        out[p + "attn_out_norm.weight"] = [p + "post_attention_layernorm.weight"]
        out[p + "mlp_out_norm.weight"] = [p + "post_feedforward_layernorm.weight"]
    return out


def gemma_common(fields: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 2 and 3 share, beside the common fields."""
    return dict(hidden_act="gelu_tanh", sandwich_norms=True,
                embed_scale=math.sqrt(fields["hidden_size"]))


def _hf_args(config: dict[str, Any]) -> DecoderArgs:
    fields = hf_common_args(config)
    n = fields["num_layers"]
    windows = hf_layer_windows(config, n)
    if not windows and config.get("sliding_window"):  # older configs: even layers slide
        windows = tuple(int(config["sliding_window"]) if i % 2 == 0 else 0 for i in range(n))
    scalar = config.get("query_pre_attn_scalar") or fields["head_dim"]
    return DecoderArgs(**fields, **gemma_common(fields), layer_windows=windows,
                       attn_scale=float(scalar) ** -0.5,
                       attn_softcap=float(config.get("attn_logit_softcapping") or 0.0),
                       final_softcap=float(config.get("final_logit_softcapping") or 0.0))


def gguf_windows(meta: GGUFMeta, num_layers: int, pattern: int) -> tuple[int, ...]:
    """llama.cpp's layout: `attention.sliding_window_pattern` where the file has it (per layer
    booleans, or N: layer i slides unless (i + 1) % N == 0), else `pattern` as N."""
    window = int(meta.key("attention.sliding_window", 0))
    if not window:
        return ()
    written = meta.get(f"{meta.arch}.attention.sliding_window_pattern")
    if isinstance(written, list | tuple):
        if len(written) != num_layers:
            raise ModelLoadError(f"{meta.path}: sliding_window_pattern has {len(written)} "
                                 f"entries for {num_layers} layers")
        return tuple(window if slides else 0 for slides in written)
    n = int(written or pattern)
    return tuple(window if (i + 1) % n else 0 for i in range(num_layers))


def gguf_attn_scale(meta: GGUFMeta, fields: dict[str, Any], layers_27b: int) -> float:
    """The score scale of a Gemma GGUF, which does not record query_pre_attn_scalar: the
    file's `attention.scale` where it has one, else llama.cpp's rule: 1/sqrt(hidden / heads)
    for the 27B size (told by its layer count), 1/sqrt(head_dim) for the others."""
    scale = meta.get(f"{meta.arch}.attention.scale")
    if scale is not None:
        return float(scale)
    if fields["num_layers"] == layers_27b:
        return float(fields["hidden_size"] // fields["num_heads"]) ** -0.5
    return float(fields["head_dim"]) ** -0.5


def _gguf_args(meta: GGUFMeta) -> DecoderArgs:
    fields = gguf_common_args(meta)
    return DecoderArgs(**fields, **gemma_common(fields),
                       layer_windows=gguf_windows(meta, fields["num_layers"], 2),
                       attn_scale=gguf_attn_scale(meta, fields, 46),
                       attn_softcap=float(meta.key("attn_logit_softcapping", 0.0)),
                       final_softcap=float(meta.key("final_logit_softcapping", 0.0)))


FAMILY = Family(name="gemma2", hf_architectures=("Gemma2ForCausalLM",),
                hf_model_types=("gemma2",), gguf_architectures=("gemma2",),
                hf_args=_hf_args, gguf_args=_gguf_args, gguf_layer_names=GEMMA_GGUF_NAMES,
                hf_sources=gemma_hf_sources, hf_norm_offset=1.0,
                notes="GeGLU, (1 + w) norms, sandwich norms, soft-caps, sliding window")
