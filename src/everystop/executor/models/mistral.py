"""Mistral: the Llama decoder; its sliding window caps the context where attention is exact.
(llama.cpp exports Mistral as GGUF architecture "llama".)"""

from __future__ import annotations

from typing import Any

from everystop.executor.models.decoder import DecoderArgs
from everystop.executor.models.family import Family, hf_common_args


def _hf_args(config: dict[str, Any]) -> DecoderArgs:
    fields = hf_common_args(config)
    if config.get("sliding_window"):
        fields["max_position_embeddings"] = min(fields["max_position_embeddings"],
                                                int(config["sliding_window"]))
    return DecoderArgs(**fields)


def _no_gguf(meta: Any) -> DecoderArgs:
    raise AssertionError("Mistral has no GGUF architecture of its own")


FAMILY = Family(name="mistral", hf_architectures=("MistralForCausalLM",),
                hf_model_types=("mistral",), gguf_architectures=(),
                hf_args=_hf_args, gguf_args=_no_gguf)
