"""Mistral: the Llama decoder with sliding-window attention on every layer (a query at p
attends keys p-W+1..p; the context is not capped by the window). llama.cpp exports Mistral as
GGUF architecture "llama": those files load as Llama, which reads the window where the file
records it (`llama.attention.sliding_window`)."""

from __future__ import annotations

from typing import Any

from everystop.executor.models.decoder import DecoderArgs
from everystop.executor.models.family import Family, GGUFMeta, hf_common_args, hf_layer_windows


def _hf_args(config: dict[str, Any]) -> DecoderArgs:
    fields = hf_common_args(config)
    windows = hf_layer_windows(config, fields["num_layers"], default_all=True)
    return DecoderArgs(**fields, layer_windows=windows)


def _no_gguf(meta: GGUFMeta) -> DecoderArgs:
    raise AssertionError("Mistral has no GGUF architecture of its own")


FAMILY = Family(name="mistral", hf_architectures=("MistralForCausalLM",),
                hf_model_types=("mistral",), gguf_architectures=(),
                hf_args=_hf_args, gguf_args=_no_gguf, notes="sliding window")
