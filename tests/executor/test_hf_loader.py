"""A tiny random Llama (untied, GQA, llama3 rope scaling) saved by transformers as safetensors,
loaded by our HF-directory loader: logits and greedy tokens must match transformers."""

from __future__ import annotations

import pytest
import torch

from everystop.config import CacheConfig, ModelConfig
from everystop.executor.model_runner import ModelRunner
from everystop.executor.models.loader import load_model
from tests.tiny_llama import llama_config, save_random_llama

from .conftest import greedy_generate


def _tiny_config(**overrides):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, rms_norm_eps=1e-5,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                rope_theta=10000.0)
    return llama_config(**(base | overrides))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    # Larger weights than the default init, so logits are far from ties and rope matters.
    return str(path), save_random_llama(_tiny_config(), path, std=0.2)


def test_tiny_llama_logits_and_greedy_match(tiny_dir):
    path, hf = tiny_dir
    # fp32 KV: an exact-reference test (16-bit caches: tests/executor/test_kv_cache_dtype.py).
    runner = ModelRunner(ModelConfig(model=path, dtype="float32"),
                         CacheConfig(num_gpu_blocks_override=64, swap_space_gib=0.0,
                                     kv_cache_dtype="float32"), 512)
    assert runner.model.args.rope_scaling["rope_type"] == "llama3"
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 90, 200)]
    ours, first = greedy_generate(runner, prompts, 16, per_seq=16)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            res = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        theirs = res.sequences[0, len(prompt):].tolist()
        assert (first[i] - res.logits[0][0]).abs().max().item() < 1e-4
        assert ours[i] == theirs


def test_hf_dir_dtypes_load(tiny_dir):
    path, _ = tiny_dir
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        model = load_model(path, dtype=dtype)
        assert model.model.embed_tokens.weight.dtype == torch_dtype
        assert model.lm_head is not None and model.lm_head.weight.dtype == torch_dtype


def test_sharded_checkpoint_loads(tiny_dir, tmp_path):
    _, hf = tiny_dir
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_model(str(tmp_path))
    ref = load_model(tiny_dir[0])
    for (name, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


def test_max_model_len_beyond_context_is_rejected(tiny_dir):
    from everystop.config import ConfigError

    with pytest.raises(ConfigError, match="exceeds the model's context"):
        ModelRunner(ModelConfig(model=tiny_dir[0]), CacheConfig(num_gpu_blocks_override=4), 4096)


def test_gguf_rope_unpermute_matches_transformers():
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from everystop.executor.models.loader import _unpermute_rope

    w = np.random.default_rng(0).standard_normal((4 * 16, 24)).astype(np.float32)
    proc = LlamaTensorProcessor(config={"num_attention_heads": 8, "num_key_value_heads": 4})
    for name, heads in (("blk.0.attn_q.weight", 8), ("blk.0.attn_k.weight", 4)):
        x = w if heads == 4 else np.concatenate([w, w[::-1]])
        assert np.array_equal(_unpermute_rope(x, heads), proc.process(x, name).weights)
