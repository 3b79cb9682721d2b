"""Tiny random-weight checkpoints of each family, built with transformers' own config classes
and saved as an HF directory (safetensors, config.json, tokenizer with the family's chat
template) and as GGUF files written with the `gguf` package the way llama.cpp exports them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

VOCAB = 300  # 256 byte tokens, the specials, unused rows
WINDOW = 16  # the windowed families' sliding window: prompts run past it


@dataclass(frozen=True)
class Spec:
    """One family's tiny checkpoint: config class and fields, GGUF architecture, specials and
    chat template (the family's turn markers), and the GGUF names that differ from Llama's."""

    name: str
    config_class: str
    config: dict[str, Any]
    gguf_arch: str | None
    specials: tuple[str, ...]
    template: str
    gguf_names: dict[str, str] = field(default_factory=dict)
    norm_offset: float = 0.0  # folded into GGUF norms, as llama.cpp does for Gemma
    windowed: bool = False


_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
          "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
          "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
          "{% endif %}")
_PHI3 = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
            "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
            "{% endfor %}")
_LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
           "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
           "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
           "{% endif %}")
_PHI3_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=256,
             eos_token_id=None, pad_token_id=0)  # no EOS: generation runs its full length
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}

SPECS = {s.name: s for s in (
    Spec("llama", "LlamaConfig", dict(_BASE, tie_word_embeddings=False), "llama",
         ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
         _LLAMA3),
    Spec("qwen2", "Qwen2Config", dict(_BASE, tie_word_embeddings=True), "qwen2",
         ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), _CHATML),
    Spec("qwen3", "Qwen3Config", dict(_BASE, tie_word_embeddings=False), "qwen3",
         ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), _CHATML),
    # llama.cpp exports Mistral as "llama", the window as llama.attention.sliding_window.
    Spec("mistral", "MistralConfig", dict(_BASE, sliding_window=WINDOW), "llama",
         ("<s>", "</s>"), _MISTRAL, windowed=True),
    Spec("phi3", "Phi3Config", dict(_BASE, num_key_value_heads=4), "phi3",
         ("<s>", "<|user|>", "<|assistant|>", "<|end|>"), _PHI3,
         gguf_names=_PHI3_NAMES),
    # LongRoPE with a 64-token pretraining length: the 70-token prompt takes the long factors,
    # the others stay within 64 tokens (short factors) while they decode. (A sequence crossing
    # the length while it decodes keeps its cache: transformers recomputes it; docs/models.md.)
    Spec("phi3-longrope", "Phi3Config",
         dict(_BASE, num_key_value_heads=4, original_max_position_embeddings=64,
              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                               "original_max_position_embeddings": 64,
                               "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                               "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 14.0, 20.0]}),
         "phi3", ("<s>", "<|user|>", "<|assistant|>", "<|end|>"), _PHI3,
         gguf_names=_PHI3_NAMES),
    Spec("gemma2", "Gemma2Config",
         dict(_BASE, sliding_window=WINDOW, query_pre_attn_scalar=32, hidden_act=None,
              hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=5.0,
              final_logit_softcapping=3.0, layer_types=["sliding_attention",
                                                        "full_attention"]),
         "gemma2", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), _GEMMA,
         gguf_names=_GEMMA_NAMES, norm_offset=1.0, windowed=True),
    Spec("gemma3", "Gemma3TextConfig",
         dict(_BASE, sliding_window=WINDOW, query_pre_attn_scalar=32,
              hidden_activation="gelu_pytorch_tanh",
              layer_types=["sliding_attention", "full_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "default",
                                                  "rope_theta": 1000000.0}}),
         "gemma3", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), _GEMMA,
         gguf_names=_GEMMA_NAMES, norm_offset=1.0, windowed=True),
)}

# The mixture-of-experts families, for the server test (test_moe_models.py holds them to
# transformers); their GGUF files are written by moe_gguf.py.
MOE_SPECS = {s.name: s for s in (
    Spec("mixtral", "MixtralConfig",
         dict(_BASE, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
              tie_word_embeddings=False), "llama", ("<s>", "</s>"), _MISTRAL),
    Spec("qwen3_moe", "Qwen3MoeConfig",
         dict(_BASE, intermediate_size=96, moe_intermediate_size=32, num_experts=16,
              num_experts_per_tok=4, norm_topk_prob=True, tie_word_embeddings=False),
         "qwen3moe", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), _CHATML),
)}


def hf_model(spec: Spec) -> Any:
    """A seeded random model in fp32 whose weights are fp16-exact (so an F16 GGUF holds the
    very same values), large enough that logits are far from ties and every part matters."""
    config = getattr(transformers, spec.config_class)(**spec.config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and MoE experts stacked in 3-D
                p.normal_(0.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:  # norms: away from their identity value
                p.normal_(1.0 - spec.norm_offset, 0.3)
            p.copy_(p.half().float())
    return model.eval()


def tokenizer(spec: Spec) -> Any:
    """A byte-level tokenizer (one token per byte, then the family's specials) with the
    family's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {tok: i for i, tok in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(spec.specials))
    bos = spec.specials[0]
    eos = spec.specials[-1] if spec.name != "mistral" else "</s>"
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                                eos_token=eos, chat_template=spec.template)


def save_hf(spec: Spec, model: Any, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer(spec).save_pretrained(path)
    return path


def permute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's export permutation for "llama": each head's rows (2, d/2) -> (d/2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _gguf_name(spec: Spec, hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             **spec.gguf_names}
    return f"blk.{layer}.{names[module]}.{kind}"


def save_gguf(spec: Spec, model: Any, path: Path, q8_0: bool = False,
              drop: str | None = None,
              metadata: Callable[[GGUFWriter], None] | None = None) -> dict[str, torch.Tensor]:
    """Write the model as GGUF (matrices F16, or Q8_0 where their rows split into blocks;
    vectors F32); `drop`: a tensor left out; `metadata`: writes more keys. Returns the HF
    state dict holding the values the file stores (Q8_0 ones dequantized), to load into a
    reference model."""
    assert spec.gguf_arch is not None
    cfg = model.config
    arch = spec.gguf_arch
    w = GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))
    if rope.get("rope_type") == "longrope":  # as llama.cpp writes Phi-3's LongRoPE
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight",
                         np.asarray(rope[f"{kind}_factor"], np.float32))
    if arch == "llama" and spec.windowed:
        w.add_sliding_window(WINDOW)
    if spec.name.startswith("gemma"):
        w.add_sliding_window(WINDOW)
        w.add_sliding_window_pattern(2)  # layer 0 slides, layer 1 attends globally
        w.add_attention_scale(cfg.query_pre_attn_scalar ** -0.5)
        if spec.name == "gemma2":
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    add_tokenizer(w, spec)
    if metadata is not None:
        metadata(w)
    # "llama" files hold Q/K rows in llama.cpp's interleaved rope order.
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads} \
        if arch == "llama" else {}
    stored: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = _gguf_name(spec, name)
        if gname == drop:
            continue
        data = t.float().numpy()
        if data.ndim == 1:
            if name.endswith("norm.weight"):
                data = data + spec.norm_offset
            w.add_tensor(gname, data.astype(np.float32))
            stored[name] = t
            continue
        # Rounding works within rows, so the rope permutation of rows commutes with it.
        n_heads = heads.get(gname.split(".")[-2], 0)
        if q8_0 and data.shape[1] % 32 == 0:
            q = quantize(data, GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, permute_rope(q, n_heads) if n_heads else q,
                         raw_dtype=GGMLQuantizationType.Q8_0)
            stored[name] = torch.from_numpy(
                dequantize(q, GGMLQuantizationType.Q8_0).reshape(data.shape).copy())
        else:
            half = data.astype(np.float16)
            w.add_tensor(gname, permute_rope(half, n_heads) if n_heads else half)
            stored[name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def add_tokenizer(w: GGUFWriter, spec: Spec) -> None:
    hf = tokenizer(spec)
    tokens = [hf.convert_ids_to_tokens(i) for i in range(len(hf))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if spec.name.startswith("qwen") else "default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in spec.specials else 1 for t in tokens])
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(hf.bos_token_id)
    w.add_eos_token_id(hf.eos_token_id)
    w.add_chat_template(spec.template)
