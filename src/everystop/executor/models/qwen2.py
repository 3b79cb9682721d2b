"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections; embeddings
tied or not. (A sliding window, where a config turns it on, applies to its `layer_types`.)"""

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
    windows = ()
    if config.get("use_sliding_window"):
        windows = hf_layer_windows(config, fields["num_layers"])
        if not windows:  # older configs: the layers from max_window_layers on
            first = int(config.get("max_window_layers", 0))
            windows = tuple(int(config["sliding_window"]) if i >= first else 0
                            for i in range(fields["num_layers"]))
    return DecoderArgs(**fields, attention_bias=True, layer_windows=windows)


def _gguf_args(meta: GGUFMeta) -> DecoderArgs:
    return DecoderArgs(**gguf_common_args(meta), attention_bias=True)


FAMILY = Family(name="qwen2", hf_architectures=("Qwen2ForCausalLM",),
                hf_model_types=("qwen2",), gguf_architectures=("qwen2",),
                hf_args=_hf_args, gguf_args=_gguf_args, notes="q/k/v bias")
