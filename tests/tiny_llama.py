"""Random-weight Llama checkpoints built by transformers (no hub): a directory our HF loader
reads, and transformers' own model as the reference to compare with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


def llama_config(**fields: Any) -> Any:
    """transformers' LlamaConfig: two layers, four heads over two KV heads, untied embeddings,
    512 positions and no EOS (tests generate every token they ask for); `fields` override."""
    import transformers

    base: dict[str, Any] = dict(num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, tie_word_embeddings=False,
                                max_position_embeddings=512, eos_token_id=None)
    return transformers.LlamaConfig(**(base | fields))


def save_random_llama(config: Any, path: Path, std: float) -> Any:
    """A Llama seeded with 0 whose matrices are drawn from N(0, std), saved as safetensors in
    `path`; returns it in eval mode. A std above transformers' init puts logits far from ties,
    so greedy tokens are a sharp test."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, name: str, kv_heads: int) -> str:
    """The small Llama (vocab 250, hidden 64, four heads) the tensor-parallel and fault tests
    serve: GQA with kv_heads=2, MQA with 1."""
    path = tmp_path_factory.mktemp(name)
    config = llama_config(vocab_size=250, hidden_size=64, intermediate_size=96,
                          num_key_value_heads=kv_heads)
    save_random_llama(config, path, std=0.2)
    return str(path)
