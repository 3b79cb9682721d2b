"""Llama-family decoder (Llama 2/3, Mistral without sliding window, SmolLM) over a flat packed
batch with a paged KV cache.

Parameter names follow Hugging Face's except two fused projections (see `fuse_hf_state_dict`):
`self_attn.qkv_proj` = [q; k; v] and `mlp.gate_up_proj` = [gate; up].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from everystop.executor.layers.attention import AttentionMetadata, paged_attention, write_kv
from everystop.executor.layers.linear import Linear, linear
from everystop.executor.layers.mlp import SwiGLU
from everystop.executor.layers.norm import RMSNorm
from everystop.executor.layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache) of one layer


@dataclass(frozen=True)
class LlamaArgs:
    """Architecture hyper-parameters, read from a GGUF header or a config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (args.num_heads, args.num_kv_heads,
                                                            args.head_dim)
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim ** -0.5
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, args.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        # NOTE: K/V are written before attention so each token sees itself and the earlier
        # tokens of this same step through the block table.
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, key_cache, value_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = SwiGLU(args.hidden_size, args.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole model. Build it under `torch.device("meta")` and load weights with
    `load_state_dict(..., assign=True)`; then call `set_rope(...)` on the target device."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = (None if args.tie_word_embeddings else
                        Linear(args.hidden_size, args.vocab_size))
        self.inv_freq: torch.Tensor = rope_inv_freq(args.head_dim, args.rope_theta,
                                                    args.rope_scaling)

    def set_rope(self, device: torch.device | str,
                 freq_factors: torch.Tensor | None = None) -> None:
        """(Re)compute the rope frequencies on `device` (not a parameter: never loaded)."""
        self.inv_freq = rope_inv_freq(self.args.head_dim, self.args.rope_theta,
                                      self.args.rope_scaling, freq_factors).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for a packed batch of T tokens."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the N hidden rows given (only the rows to sample)."""
        weight = (self.model.embed_tokens.weight if self.lm_head is None else
                  self.lm_head.weight)
        return linear(hidden, weight).float()


def fuse_hf_state_dict(hf: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Map Hugging Face Llama parameter names onto ours, concatenating q/k/v and gate/up.

    Unknown extra tensors (e.g. rotary caches) are dropped; a missing one raises KeyError.
    """
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": hf["model.embed_tokens.weight"],
                                    "model.norm.weight": hf["model.norm.weight"]}
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0)
        out[p + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0)
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = hf[p + norm + ".weight"]
    return out
