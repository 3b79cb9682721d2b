"""Write a transformers Mixtral or Qwen3-MoE model as a GGUF file the way llama.cpp's converter
lays one out: Mixtral under architecture "llama" (expert_count set, Q/K rows interleaved for
its rope), Qwen3-MoE as "qwen3moe" (q/k norms, expert_feed_forward_length); each layer's
router as `ffn_gate_inp` (F32) and its experts stacked as `ffn_{gate,up,down}_exps`.

`state` is the checkpoint as save_pretrained writes it (one tensor per expert). Returns it
again holding the values the file holds (F16 or Q8_0 rounded), for a transformers reference
that computes with exactly the same weights. With a family_builders `spec`, the file also
holds its tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from .family_builders import Spec, add_tokenizer, permute_rope

KINDS = {"f16": GGMLQuantizationType.F16, "q8_0": GGMLQuantizationType.Q8_0}


def write_moe_gguf(config: Any, checkpoint: dict[str, torch.Tensor], path: Path, kind: str,
                   spec: Spec | None = None) -> dict[str, torch.Tensor]:
    mixtral = config.model_type == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    state = {k: v.float() for k, v in checkpoint.items()}
    held: dict[str, torch.Tensor] = {}
    writer = GGUFWriter(str(path), arch)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if mixtral:
        writer.add_expert_count(config.num_local_experts)
    else:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_weights_norm(config.norm_topk_prob)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if spec is not None:  # the tokenizer and chat template of a servable file
        add_tokenizer(writer, spec)

    def add(name: str, hf_names: list[str], matrix: bool = True, heads: int = 0) -> None:
        w = np.stack([state[n].numpy() for n in hf_names]) if len(hf_names) > 1 else \
            state[hf_names[0]].numpy()
        if not matrix:  # norms and the router stay F32, as llama.cpp keeps them
            data, values = w.astype(np.float32), w
        elif kind == "f16":
            data = w.astype(np.float16)
            values = data.astype(np.float32)
        else:
            data = quantize(w.astype(np.float32), KINDS[kind])
            values = dequantize(data, KINDS[kind]).reshape(w.shape)
        # Rounding works within rows, so the rope permutation of rows commutes with it.
        writer.add_tensor(name, permute_rope(data, heads) if heads else data,
                          raw_dtype=KINDS[kind] if matrix and kind != "f16" else None)
        for i, n in enumerate(hf_names):
            v = values if len(hf_names) == 1 else values[i]
            held[n] = torch.from_numpy(np.ascontiguousarray(v, np.float32))

    add("token_embd.weight", ["model.embed_tokens.weight"])
    add("output_norm.weight", ["model.norm.weight"], matrix=False)
    if not config.tie_word_embeddings:
        add("output.weight", ["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        moe = p + ("block_sparse_moe." if mixtral else "mlp.")
        q_heads, k_heads = ((config.num_attention_heads, config.num_key_value_heads) if mixtral
                            else (0, 0))
        add(b + "attn_norm.weight", [p + "input_layernorm.weight"], matrix=False)
        add(b + "ffn_norm.weight", [p + "post_attention_layernorm.weight"], matrix=False)
        add(b + "attn_q.weight", [p + "self_attn.q_proj.weight"], heads=q_heads)
        add(b + "attn_k.weight", [p + "self_attn.k_proj.weight"], heads=k_heads)
        add(b + "attn_v.weight", [p + "self_attn.v_proj.weight"])
        add(b + "attn_output.weight", [p + "self_attn.o_proj.weight"])
        if not mixtral:
            add(b + "attn_q_norm.weight", [p + "self_attn.q_norm.weight"], matrix=False)
            add(b + "attn_k_norm.weight", [p + "self_attn.k_norm.weight"], matrix=False)
        if moe + "gate.weight" not in state:  # a dense layer (Qwen3-MoE's mlp_only_layers)
            for gguf_kind in ("gate", "up", "down"):
                add(b + f"ffn_{gguf_kind}.weight", [p + f"mlp.{gguf_kind}_proj.weight"])
            continue
        add(b + "ffn_gate_inp.weight", [moe + "gate.weight"], matrix=False)
        num = config.num_local_experts if mixtral else config.num_experts
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for gguf_kind, hf in zip(("gate", "up", "down"), names, strict=True):
            add(b + f"ffn_{gguf_kind}_exps.weight",
                [moe + f"experts.{e}.{hf}.weight" for e in range(num)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
