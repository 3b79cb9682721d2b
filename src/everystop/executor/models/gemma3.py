"""Gemma 3 (text): Gemma 2's layer (models/gemma2.py) without soft-caps, with q/k norms, five
sliding-window layers to each global one, and the windowed layers' own rope base."""

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
from everystop.executor.models.gemma2 import (
    GEMMA_GGUF_NAMES,
    gemma_common,
    gemma_hf_sources,
    gguf_attn_scale,
    gguf_windows,
)

_LOCAL_THETA = 10000.0  # Gemma 3's windowed layers' rope base where nothing says otherwise


def _hf_args(config: dict[str, Any]) -> DecoderArgs:
    rope = config.get("rope_parameters") or {}
    local_theta = float(config.get("rope_local_base_freq") or _LOCAL_THETA)
    if "full_attention" in rope:  # per layer type: read the global layers' as the model's
        local_theta = float(rope.get("sliding_attention", {}).get("rope_theta", local_theta))
        config = {**config, "rope_parameters": rope["full_attention"]}
    fields = hf_common_args(config)
    n = fields["num_layers"]
    windows = hf_layer_windows(config, n)
    if not windows and config.get("sliding_window"):
        pattern = int(config.get("sliding_window_pattern") or 6)
        windows = tuple(int(config["sliding_window"]) if (i + 1) % pattern else 0
                        for i in range(n))
    scalar = config.get("query_pre_attn_scalar") or fields["head_dim"]
    return DecoderArgs(**fields, **gemma_common(fields), qk_norm=True, layer_windows=windows,
                       attn_scale=float(scalar) ** -0.5, local_rope_theta=local_theta,
                       attn_softcap=float(config.get("attn_logit_softcapping") or 0.0),
                       final_softcap=float(config.get("final_logit_softcapping") or 0.0))


def _gguf_args(meta: GGUFMeta) -> DecoderArgs:
    fields = gguf_common_args(meta)
    return DecoderArgs(**fields, **gemma_common(fields), qk_norm=True,
                       layer_windows=gguf_windows(meta, fields["num_layers"], 6),
                       attn_scale=gguf_attn_scale(meta, fields, 62),
                       local_rope_theta=float(meta.key("rope.freq_base_swa", _LOCAL_THETA)))


FAMILY = Family(name="gemma3", hf_architectures=("Gemma3ForCausalLM",),
                hf_model_types=("gemma3_text",), gguf_architectures=("gemma3",),
                hf_args=_hf_args, gguf_args=_gguf_args, gguf_layer_names=GEMMA_GGUF_NAMES,
                hf_sources=gemma_hf_sources, hf_norm_offset=1.0,
                notes="GeGLU, (1 + w) norms, sandwich norms, q/k norm, local/global layers")
