"""A servable GGUF file of any family, tokenizer and chat template included: the dense
families through family_builders.save_gguf, the mixture-of-experts ones through moe_gguf."""

from __future__ import annotations

from pathlib import Path

from .family_builders import MOE_SPECS, SPECS, Spec, hf_model, save_gguf
from .moe_gguf import write_moe_gguf

# Every architecture the registry serves, by its family name.
SERVED = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "mixtral",
          "qwen3_moe")


def family_spec(name: str) -> Spec:
    return SPECS.get(name) or MOE_SPECS[name]


def write_family_gguf(name: str, directory: Path) -> Path:
    """An F16 GGUF of the family's tiny random model, at directory/<name>.gguf."""
    from safetensors.torch import load_file

    spec = family_spec(name)
    model = hf_model(spec)
    path = directory / f"{name}.gguf"
    if name in MOE_SPECS:
        # save_pretrained writes one tensor per expert, the layout moe_gguf stacks.
        model.save_pretrained(directory / "hf", safe_serialization=True)
        write_moe_gguf(model.config, load_file(directory / "hf" / "model.safetensors"), path,
                       "f16", spec)
    else:
        save_gguf(spec, model, path)
    return path
