"""Every model family everystop serves, looked up by a checkpoint's own names: config.json's
`architectures` (or `model_type`) and GGUF's `general.architecture`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from everystop.executor.models import (
    gemma2,
    gemma3,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from everystop.executor.models.errors import ModelLoadError
from everystop.executor.models.family import Family

# NOTE: first match wins: Mixtral and Mistral before Llama, whose GGUF architecture they share
# (a "llama" file with experts, or with a sliding window).
FAMILIES: tuple[Family, ...] = (mixtral.FAMILY, mistral.FAMILY, llama.FAMILY, qwen2.FAMILY,
                                qwen3.FAMILY, qwen3_moe.FAMILY, phi3.FAMILY, gemma2.FAMILY,
                                gemma3.FAMILY)


def supported_hf_architectures() -> list[str]:
    return [a for f in FAMILIES for a in f.hf_architectures]


def supported_gguf_architectures() -> list[str]:
    return list(dict.fromkeys(a for f in FAMILIES for a in f.gguf_architectures))


def family_for_hf(config: dict[str, Any], path: str) -> Family:
    """The family of a config.json: by `architectures`, or by `model_type` where it lists none.
    An unsupported one is a ModelLoadError naming it and listing the supported ones."""
    archs = config.get("architectures") or []
    for family in FAMILIES:
        if set(archs) & set(family.hf_architectures):
            return family
        if not archs and config.get("model_type") in family.hf_model_types:
            return family
    found = ", ".join(archs) or config.get("model_type")
    raise ModelLoadError(f"{path}: unsupported architecture {found!r} "
                         f"(supported: {', '.join(supported_hf_architectures())})")


def family_for_gguf(arch: Any, path: str, fields: Mapping[str, Any] | None = None) -> Family:
    """The family of a GGUF file's `general.architecture` (and, where a family needs them, its
    metadata `fields`); unsupported: a ModelLoadError."""
    for family in FAMILIES:
        if arch in family.gguf_architectures and (
                family.gguf_accepts is None or family.gguf_accepts(fields or {})):
            return family
    raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} "
                         f"(supported: {', '.join(supported_gguf_architectures())})")
