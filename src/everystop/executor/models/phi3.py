"""Phi-3 / Phi-3.5: the Llama decoder whose checkpoints already hold the fused projections
(`qkv_proj`, `gate_up_proj`: the decoder's own names), a sliding window on every layer where
the config sets one, LongRoPE scaling (layers/rotary.py): from config.json, or from a GGUF file
where llama.cpp writes its factors as `rope_factors_{long,short}.weight` tensors beside
`phi3.rope.scaling.original_context_length` and `.attn_factor`. Partial rotary is refused."""

from __future__ import annotations

from typing import Any

import numpy as np

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


def _gguf_longrope(meta: GGUFMeta) -> dict[str, Any] | None:
    """LongRoPE's scaling as config.json writes it, from llama.cpp's GGUF layout; None where
    the file has no factors."""
    if "rope_factors_long.weight" not in meta.tensors:
        return None
    factors = {}
    for kind in ("long", "short"):
        tensor = meta.tensors.get(f"rope_factors_{kind}.weight")
        if tensor is None:
            raise ModelLoadError(f"{meta.path}: missing tensor rope_factors_{kind}.weight "
                                 "(LongRoPE)")
        factors[f"{kind}_factor"] = [float(v) for v in np.asarray(tensor.data, np.float32)
                                     .reshape(-1)]
    scaling: dict[str, Any] = {
        "rope_type": "longrope", **factors,
        "original_max_position_embeddings": int(meta.key("rope.scaling.original_context_length"))}
    attention = meta.fields.get(f"{meta.arch}.rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


def _gguf_args(meta: GGUFMeta) -> DecoderArgs:
    fields = gguf_common_args(meta)
    longrope = _gguf_longrope(meta)
    if longrope is not None:
        fields["rope_scaling"] = longrope
    return DecoderArgs(**fields, layer_windows=gguf_layer_windows(meta, fields["num_layers"]))


FAMILY = Family(name="phi3", hf_architectures=("Phi3ForCausalLM",),
                hf_model_types=("phi3",), gguf_architectures=("phi3",),
                hf_args=_hf_args, gguf_args=_gguf_args, hf_sources=_phi3_sources,
                gguf_layer_names={"attn_qkv": "self_attn.qkv_proj",
                                  "ffn_up": "mlp.gate_up_proj"},
                notes="fused qkv and gate_up checkpoints, LongRoPE")
