"""Checkpoints a family cannot serve fail at start-up with a one-line error naming what is
wrong: an architecture outside the registry, a GGUF or safetensors checkpoint missing a tensor,
a rope scaling we do not compute (config.json or GGUF metadata); `everystop serve` prints it
and exits 2 before it listens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFWriter, RopeScalingType
from safetensors.torch import load_file, save_file

from everystop.executor.models.loader import ModelLoadError, load_model
from everystop.executor.models.registry import (
    supported_gguf_architectures,
    supported_hf_architectures,
)
from tests.server.conftest import ROOT

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


def test_a_checkpoint_missing_a_tensor_names_it(tmp_path):
    spec = SPECS["qwen2"]
    save_hf(spec, hf_model(spec), tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    del state["model.layers.1.self_attn.k_proj.bias"]
    save_file(state, weights, metadata={"format": "pt"})
    assert "model.layers.1.self_attn.k_proj.bias" in _error(tmp_path)


@pytest.mark.parametrize("kind", [RopeScalingType.YARN, RopeScalingType.LONGROPE])
def test_a_gguf_rope_scaling_we_do_not_compute_names_it(tmp_path, kind):
    spec = SPECS["qwen2"]
    path = tmp_path / "m.gguf"

    def scaled(w: GGUFWriter) -> None:
        w.add_rope_scaling_type(kind)
        w.add_rope_scaling_factor(4.0)

    save_gguf(spec, hf_model(spec), path, metadata=scaled)
    message = _error(path)
    assert repr(kind.value) in message and "rope" in message


def test_a_phi3_gguf_with_half_its_longrope_names_what_is_missing(tmp_path):
    """llama.cpp writes Phi-3's LongRoPE as two factor tensors and the pretraining length: a
    file with the long factors alone is refused, naming the short ones."""
    spec = SPECS["phi3"]
    path = tmp_path / "m.gguf"
    half = spec.config["head_dim"] // 2

    def longrope(w: GGUFWriter) -> None:
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_tensor("rope_factors_long.weight", np.full(half, 4.0, np.float32))

    save_gguf(spec, hf_model(spec), path, metadata=longrope)
    assert "missing tensor rope_factors_short.weight" in _error(path)


def test_serve_refuses_a_bad_checkpoint_at_start_up_in_one_line(tmp_path):
    spec = SPECS["qwen3"]
    path = tmp_path / "m.gguf"
    save_gguf(spec, hf_model(spec), path, drop="blk.0.attn_q_norm.weight")
    proc = subprocess.run([sys.executable, "-m", "everystop", "serve", "--model", str(path),
                           "--port", "0"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("everystop: cannot start:")
    assert "missing tensor model.layers.0.self_attn.q_norm.weight" in last
    assert "Traceback" not in proc.stderr


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
