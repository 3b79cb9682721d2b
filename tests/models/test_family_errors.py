"""Checkpoints a family cannot serve fail at start-up with a one-line error naming what is
wrong: an architecture outside the registry, a GGUF missing a tensor, a rope scaling we do not
compute."""

from __future__ import annotations

import json

import pytest
from gguf import GGUFWriter

from everystop.executor.models.loader import ModelLoadError, load_model
from everystop.executor.models.registry import (
    supported_gguf_architectures,
    supported_hf_architectures,
)

from .family_builders import SPECS, hf_model, save_gguf, save_hf


def _error(path) -> str:
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_an_architecture_outside_the_registry_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}))
    message = _error(tmp_path)
    assert "GPTNeoXForCausalLM" in message
    assert all(a in message for a in supported_hf_architectures())
    assert {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
            "Gemma2ForCausalLM", "Gemma3ForCausalLM"} <= set(supported_hf_architectures())


def test_a_gguf_architecture_outside_the_registry_lists_the_supported_ones(tmp_path):
    path = tmp_path / "x.gguf"
    w = GGUFWriter(str(path), "falcon")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    message = _error(path)
    assert "'falcon'" in message and all(a in message for a in supported_gguf_architectures())


def test_a_gguf_missing_a_tensor_names_it(tmp_path):
    spec = SPECS["qwen3"]
    path = tmp_path / "m.gguf"
    save_gguf(spec, hf_model(spec), path, drop="blk.1.attn_k_norm.weight")
    assert "missing tensor model.layers.1.self_attn.k_norm.weight" in _error(path)


@pytest.mark.parametrize(("family", "rope", "named"), [
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
     "'yarn'"),
    ("phi3", {"rope_type": "dynamic", "factor": 2.0}, "'dynamic'"),
])
def test_an_unsupported_rope_scaling_names_it(tmp_path, family, rope, named):
    spec = SPECS[family]
    save_hf(spec, hf_model(spec), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = _error(tmp_path)
    assert named in message and "rope" in message
