"""Write a GGUF with random weights in the Llama-3.2-1B shape (16 layers, hidden 2048, 32/8
heads of 64, FFN 8192, vocab 128,256, tied embeddings), in F16, Q8_0 or Q4_0, with the gguf
package's writer: a realistic size to measure memory and speed on (random weights are fine
for both; correctness is judged on the real default model).

The tokenizer is the default model's (SmolLM2's BPE), its vocabulary padded with unused
tokens up to 128,256 so the embedding's rows match. Block formats are written as random
blocks directly (random scales and codes: random weights all the same) so a 1B model takes
seconds, not a quantizer's minutes. Tensors stream to the file one at a time.

    python scripts/make_llama1b_gguf.py --type q8_0 --out /tmp/llama1b-q8_0.gguf
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 16, 2048, 32, 8, 64, 8192, 128256
TYPES = {"f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
         "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
         "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0)}
STD = 0.02  # weights' standard deviation


def tensors() -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(name, [rows, cols]) of every tensor; 1-D ones are the norms."""
    out: list[tuple[str, tuple[int, int] | tuple[int]]] = [("token_embd.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (HIDDEN,)), (b + "ffn_norm.weight", (HIDDEN,)),
                (b + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN)),
                (b + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
                (b + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
                (b + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM)),
                (b + "ffn_gate.weight", (FFN, HIDDEN)), (b + "ffn_up.weight", (FFN, HIDDEN)),
                (b + "ffn_down.weight", (HIDDEN, FFN))]
    return out + [("output_norm.weight", (HIDDEN,))]


def random_tensor(shape: tuple[int, ...], kind: GGMLQuantizationType,
                  rng: np.random.Generator) -> np.ndarray:
    """F32 ones for a norm; else random F16 values or random blocks (uint8 [rows, bytes])."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    rows, cols = shape
    if kind == GGMLQuantizationType.F16:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * STD).astype(np.float16)
    blocks = cols // 32
    if kind == GGMLQuantizationType.Q8_0:  # codes uniform in [-127, 127]: std ~ 73 d
        scale = np.full((rows, blocks, 1), STD / 73, dtype=np.float16).view(np.uint8)
        codes = rng.integers(-127, 128, (rows, blocks, 32), dtype=np.int8).view(np.uint8)
    else:  # Q4_0: nibbles uniform in [0, 15] around 8: std ~ 4.6 d
        scale = np.full((rows, blocks, 1), STD / 4.6, dtype=np.float16).view(np.uint8)
        codes = rng.integers(0, 256, (rows, blocks, 16), dtype=np.uint8)
    return np.concatenate([scale, codes], axis=-1).reshape(rows, -1)


def _stored(shape: tuple[int, ...], kind: GGMLQuantizationType
            ) -> tuple[tuple[int, ...], np.dtype, GGMLQuantizationType]:
    """How a tensor is stored: (array shape, array dtype, GGML type); blocks as uint8 bytes."""
    if len(shape) == 1:
        return shape, np.dtype(np.float32), GGMLQuantizationType.F32
    if kind == GGMLQuantizationType.F16:
        return shape, np.dtype(np.float16), kind
    block_bytes = 34 if kind == GGMLQuantizationType.Q8_0 else 18
    return (shape[0], shape[1] // 32 * block_bytes), np.dtype(np.uint8), kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--type", choices=sorted(TYPES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kind, file_type = TYPES[args.type]
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
    writer.add_file_type(file_type)
    _add_tokenizer(writer)
    specs = tensors()
    for name, shape in specs:
        stored, dtype, t = _stored(shape, kind)
        writer.add_tensor_info(name, stored, dtype, int(np.prod(stored)) * dtype.itemsize,
                               raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    for _name, shape in specs:
        writer.write_tensor_data(random_tensor(shape, kind, rng))
    writer.close()
    print(f"wrote {args.out}: {sum(int(np.prod(s)) for _, s in specs) / 1e9:.3f}B parameters "
          f"as {args.type}")


def _add_tokenizer(writer: GGUFWriter) -> None:
    """The default model's BPE tokenizer, its vocabulary padded to VOCAB with unused tokens."""
    from everystop.executor.models.loader import default_model_path

    reader = GGUFReader(default_model_path())
    field = reader.fields
    tokens = list(field["tokenizer.ggml.tokens"].contents())
    types = list(field["tokenizer.ggml.token_type"].contents())
    pad = VOCAB - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [5] * pad  # UNUSED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(str(field["tokenizer.ggml.pre"].contents()))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(field["tokenizer.ggml.merges"].contents()))
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id),
                     ("padding_token_id", writer.add_pad_token_id)):
        add(int(field[f"tokenizer.ggml.{key}"].contents()))
    writer.add_chat_template(str(field["tokenizer.chat_template"].contents()))


if __name__ == "__main__":
    main()
