"""Write a random-weight Qwen3-MoE GGUF ("qwen3moe", llama.cpp's layout) for speed and memory
measurements: 24 layers, hidden 1024, 16/4 heads of 64 with q/k norms, 64 experts of 384 with
8 chosen per token, vocab 151,936 untied: ~2.19B parameters in all, ~0.45B active per token
(attention, the 8 chosen experts and the LM head). Q8_0 or Q4_0 (or F16); see
everystop.bench.random_gguf.

    python scripts/make_moe_gguf.py --type q8_0 --out /tmp/qwen3moe-2b-q8_0.gguf
"""

from __future__ import annotations

import argparse

from gguf import GGUFWriter

from everystop.bench.random_gguf import (
    TYPES,
    TensorSpec,
    add_default_tokenizer,
    write_random_tensors,
)

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 24, 1024, 16, 4, 64, 151936
EXPERTS, USED, EXPERT_FFN = 64, 8, 384


def tensors() -> list[TensorSpec]:
    """(name, shape) of every tensor, GGUF's stacked experts as [experts, rows, cols]."""
    out: list[TensorSpec] = [("token_embd.weight", (VOCAB, HIDDEN)),
                             ("output.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (HIDDEN,)), (b + "ffn_norm.weight", (HIDDEN,)),
                (b + "attn_q_norm.weight", (HEAD_DIM,)), (b + "attn_k_norm.weight", (HEAD_DIM,)),
                (b + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN)),
                (b + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
                (b + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
                (b + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM)),
                (b + "ffn_gate_inp.weight", (EXPERTS, HIDDEN)),
                (b + "ffn_gate_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN)),
                (b + "ffn_up_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN)),
                (b + "ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FFN))]
    return out + [("output_norm.weight", (HIDDEN,))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--type", choices=sorted(TYPES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    writer = GGUFWriter(args.out, "qwen3moe")
    writer.add_name(f"random-qwen3moe-2b-{args.type}")
    writer.add_block_count(LAYERS)
    writer.add_context_length(32768)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(EXPERT_FFN * USED)  # no dense layer uses it
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(USED)
    writer.add_expert_feed_forward_length(EXPERT_FFN)
    add_default_tokenizer(writer, VOCAB)
    count = write_random_tensors(writer, tensors(), args.type, args.seed)
    active = count - LAYERS * (EXPERTS - USED) * 3 * HIDDEN * EXPERT_FFN - VOCAB * HIDDEN
    print(f"wrote {args.out}: {count / 1e9:.3f}B parameters ({active / 1e9:.3f}B active) "
          f"as {args.type}")


if __name__ == "__main__":
    main()
