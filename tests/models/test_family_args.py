"""Hyper-parameters each family reads from config.json and GGUF headers, including the older
config layouts real checkpoints ship (no `layer_types`, Gemma 3's `rope_local_base_freq`)."""

from __future__ import annotations

from everystop.executor.models import gemma2, gemma3, mistral, qwen2
from everystop.executor.models.family import GGUFMeta

BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 32768}


def test_mistral_window_limits_attention_not_the_context() -> None:
    args = mistral.FAMILY.hf_args({**BASE, "sliding_window": 4096})
    assert args.layer_windows == (4096,) * 6 and args.max_position_embeddings == 32768
    assert mistral.FAMILY.hf_args({**BASE, "sliding_window": None}).layer_windows == ()


def test_qwen2_windows_from_max_window_layers() -> None:
    config = {**BASE, "sliding_window": 512, "use_sliding_window": True, "max_window_layers": 4}
    assert qwen2.FAMILY.hf_args(config).layer_windows == (0, 0, 0, 0, 512, 512)
    assert qwen2.FAMILY.hf_args({**config, "use_sliding_window": False}).layer_windows == ()


def test_gemma3_older_config_layout() -> None:
    config = {**BASE, "sliding_window": 1024, "sliding_window_pattern": 6,
              "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 168,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    args = gemma3.FAMILY.hf_args(config)
    assert args.layer_windows == (1024,) * 5 + (0,)
    assert args.rope_theta == 1e6 and args.local_rope_theta == 1e4
    assert args.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert args.attn_scale == 168 ** -0.5 and args.embed_scale == 8.0


def _meta(arch: str, layers: int, **extra: object) -> GGUFMeta:
    fields = {f"{arch}.{k}": v for k, v in {
        "embedding_length": 4608, "attention.head_count": 32, "attention.key_length": 128,
        "feed_forward_length": 128, "block_count": layers, "attention.sliding_window": 4096,
        **extra}.items()}

    class Tensor:
        shape = (4608, 256)

    return GGUFMeta(fields, arch, {"token_embd.weight": Tensor()}, "x.gguf")


def test_gemma_gguf_attention_scale_follows_llama_cpp() -> None:
    assert gemma2.FAMILY.gguf_args(_meta("gemma2", 46)).attn_scale == 144 ** -0.5  # 27B
    assert gemma2.FAMILY.gguf_args(_meta("gemma2", 42)).attn_scale == 128 ** -0.5
    written = gemma2.FAMILY.gguf_args(_meta("gemma2", 46, **{"attention.scale": 0.1}))
    assert written.attn_scale == 0.1
    g3 = gemma3.FAMILY.gguf_args(_meta("gemma3", 12))
    assert g3.layer_windows == (4096,) * 5 + (0,) + (4096,) * 5 + (0,)
    assert g3.local_rope_theta == 10000.0
