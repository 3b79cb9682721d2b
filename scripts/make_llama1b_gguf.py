"""Write a GGUF with random weights in the Llama-3.2-1B shape (16 layers, hidden 2048, 32/8
heads of 64, FFN 8192, vocab 128,256, tied embeddings), in F16, Q8_0 or Q4_0 (see
everystop.bench.random_gguf): a realistic size to measure memory and speed on.

    python scripts/make_llama1b_gguf.py --type q8_0 --out /tmp/llama1b-q8_0.gguf
"""

from __future__ import annotations

import argparse

from gguf import GGUFWriter

from everystop.bench.random_gguf import (
    TYPES,
    TensorSpec,
    add_default_tokenizer,
    llama_tensors,
    write_random_tensors,
)

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 16, 2048, 32, 8, 64, 8192, 128256


def tensors() -> list[TensorSpec]:
    """(name, [rows, cols]) of every tensor; 1-D ones are the norms."""
    return llama_tensors(LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--type", choices=sorted(TYPES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    writer = GGUFWriter(args.out, "llama")
    writer.add_name(f"random-llama-3.2-1b-shape-{args.type}")
    writer.add_block_count(LAYERS)
    writer.add_context_length(8192)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    add_default_tokenizer(writer, VOCAB)
    count = write_random_tensors(writer, tensors(), args.type, args.seed)
    print(f"wrote {args.out}: {count / 1e9:.3f}B parameters as {args.type}")


if __name__ == "__main__":
    main()
