"""Llama 2/3 (and SmolLM): the shared decoder as it is, SwiGLU, RMSNorm, rotary (default,
linear or llama3 scaling), and a sliding window on every layer where the GGUF records
`llama.attention.sliding_window` (such a file is claimed by the Mistral family first)."""

from __future__ import annotations

from typing import Any

from everystop.executor.models.decoder import DecoderArgs
from everystop.executor.models.family import (
    Family,
    GGUFMeta,
    gguf_common_args,
    gguf_layer_windows,
    hf_common_args,
)


def _hf_args(config: dict[str, Any]) -> DecoderArgs:
    return DecoderArgs(**hf_common_args(config))


def _gguf_args(meta: GGUFMeta) -> DecoderArgs:
    fields = gguf_common_args(meta)
    return DecoderArgs(**fields, layer_windows=gguf_layer_windows(meta, fields["num_layers"]))


FAMILY = Family(name="llama", hf_architectures=("LlamaForCausalLM",),
                hf_model_types=("llama",), gguf_architectures=("llama",),
                hf_args=_hf_args, gguf_args=_gguf_args, gguf_permuted_qk=True)
