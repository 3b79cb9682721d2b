"""Mistral: the Llama decoder with sliding-window attention on every layer (a query at p
attends keys p-W+1..p; the context is not capped by the window). llama.cpp exports Mistral as
GGUF architecture "llama"; a "llama" file that records a window
(`llama.attention.sliding_window`) is this family's, read as Llama reads it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from everystop.executor.models import llama
from everystop.executor.models.decoder import DecoderArgs
from everystop.executor.models.family import Family, hf_common_args, hf_layer_windows


def _hf_args(config: dict[str, Any]) -> DecoderArgs:
    fields = hf_common_args(config)
    windows = hf_layer_windows(config, fields["num_layers"], default_all=True)
    return DecoderArgs(**fields, layer_windows=windows)


def is_mistral_gguf(fields: Mapping[str, Any]) -> bool:
    """A dense "llama" GGUF file with a sliding window is a Mistral."""
    return (int(fields.get("llama.attention.sliding_window") or 0) > 0
            and not int(fields.get("llama.expert_count") or 0))


FAMILY = Family(name="mistral", hf_architectures=("MistralForCausalLM",),
                hf_model_types=("mistral",), gguf_architectures=("llama",),
                hf_args=_hf_args, gguf_args=llama.FAMILY.gguf_args, gguf_permuted_qk=True,
                gguf_accepts=is_mistral_gguf, notes="sliding window")
