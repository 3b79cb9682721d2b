"""Every user-caused load failure is a ModelLoadError with a one-line message."""

from __future__ import annotations

import json
import os

import pytest

from everystop.executor.models.loader import ModelLoadError, load_model


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg
    return msg


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path / "nope.gguf"))
    assert "does not exist" in _one_line(err)


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path))
    assert "x.gguf" in _one_line(err)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    assert "GPT2LMHeadModel" in _one_line(err)


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    assert "config.json" in _one_line(err)


def test_missing_tensor(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8,
              "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8),
               "model.norm.weight": torch.ones(8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    assert "missing tensor model.layers.0.self_attn.q_proj.weight" in _one_line(err)


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["MistralForCausalLM"], "vocab_size": 16, "hidden_size": 8,
         "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    assert "safetensors" in _one_line(err)


def test_bad_dtype():
    with pytest.raises(ModelLoadError):
        load_model(None, dtype="int8")
