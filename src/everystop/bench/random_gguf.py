"""Random-weight GGUF files of realistic shapes, to measure memory and speed on (random weights
are fine for both; correctness is judged on real models and against transformers).

Block formats are written as random blocks directly (random scales and codes: random weights
all the same), so a model of billions of parameters takes seconds, not a quantizer's minutes.
Tensors stream to the file one at a time. The tokenizer is the default model's (SmolLM2's
BPE), its vocabulary padded up to the model's vocabulary size with tokens no text encodes to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType

TYPES = {"f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
         "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
         "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0)}
STD = 0.02  # weights' standard deviation

# (name, shape as [..., rows, cols]); 1-D tensors are norms (ones), `F32_MATRICES` stay F32.
TensorSpec = tuple[str, tuple[int, ...]]
F32_MATRICES = ("ffn_gate_inp",)  # MoE routers: llama.cpp keeps them F32
PADDING_TOKEN_TYPE = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL


def _kind_of(name: str, shape: Sequence[int], kind: GGMLQuantizationType
             ) -> GGMLQuantizationType:
    if len(shape) == 1 or any(f".{m}." in name for m in F32_MATRICES):
        return GGMLQuantizationType.F32
    return kind


def random_tensor(name: str, shape: tuple[int, ...], kind: GGMLQuantizationType,
                  rng: np.random.Generator) -> np.ndarray:
    """F32 ones for a norm, random F32 for an F32 matrix; else random F16 values or random
    blocks (uint8 [..., rows, bytes])."""
    kind = _kind_of(name, shape, kind)
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = rng.standard_normal(shape, dtype=np.float32) * STD
        return values if kind == GGMLQuantizationType.F32 else values.astype(np.float16)
    *outer, cols = shape
    blocks = (*outer, cols // 32)
    if kind == GGMLQuantizationType.Q8_0:  # codes uniform in [-127, 127]: std ~ 73 d
        scale = np.full((*blocks, 1), STD / 73, dtype=np.float16).view(np.uint8)
        codes = rng.integers(-127, 128, (*blocks, 32), dtype=np.int8).view(np.uint8)
    else:  # Q4_0: nibbles uniform in [0, 15] around 8: std ~ 4.6 d
        scale = np.full((*blocks, 1), STD / 4.6, dtype=np.float16).view(np.uint8)
        codes = rng.integers(0, 256, (*blocks, 16), dtype=np.uint8)
    return np.concatenate([scale, codes], axis=-1).reshape(*outer, -1)


def _stored(name: str, shape: tuple[int, ...], kind: GGMLQuantizationType
            ) -> tuple[tuple[int, ...], np.dtype, GGMLQuantizationType]:
    """How a tensor is stored: (array shape, array dtype, GGML type); blocks as uint8 bytes."""
    kind = _kind_of(name, shape, kind)
    if kind == GGMLQuantizationType.F32:
        return shape, np.dtype(np.float32), kind
    if kind == GGMLQuantizationType.F16:
        return shape, np.dtype(np.float16), kind
    block_bytes = 34 if kind == GGMLQuantizationType.Q8_0 else 18
    return (*shape[:-1], shape[-1] // 32 * block_bytes), np.dtype(np.uint8), kind


def llama_tensors(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                  ffn: int, vocab: int) -> list[TensorSpec]:
    """(name, shape) of every tensor of a Llama-shaped GGUF (tied LM head); 1-D: the norms."""
    out: list[TensorSpec] = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (hidden,)), (b + "ffn_norm.weight", (hidden,)),
                (b + "attn_q.weight", (heads * head_dim, hidden)),
                (b + "attn_k.weight", (kv_heads * head_dim, hidden)),
                (b + "attn_v.weight", (kv_heads * head_dim, hidden)),
                (b + "attn_output.weight", (hidden, heads * head_dim)),
                (b + "ffn_gate.weight", (ffn, hidden)), (b + "ffn_up.weight", (ffn, hidden)),
                (b + "ffn_down.weight", (hidden, ffn))]
    return out + [("output_norm.weight", (hidden,))]


def write_random_tensors(writer: GGUFWriter, specs: list[TensorSpec], type_name: str,
                         seed: int = 0) -> int:
    """Write the header (metadata added before), then every tensor of `specs` with random
    values in `type_name` (TYPES). Returns the parameter count."""
    kind, file_type = TYPES[type_name]
    writer.add_file_type(file_type)
    for name, shape in specs:
        stored, dtype, t = _stored(name, shape, kind)
        writer.add_tensor_info(name, stored, dtype, math.prod(stored) * dtype.itemsize,
                               raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in specs:
        writer.write_tensor_data(random_tensor(name, shape, kind, rng))
    writer.close()
    return sum(math.prod(s) for _, s in specs)


def add_default_tokenizer(writer: GGUFWriter, vocab: int) -> None:
    """The default model's BPE tokenizer, its vocabulary padded to `vocab` with tokens no text
    encodes to (`<|unused_N|>`), which both engines decode to their names."""
    from everystop.executor.models.loader import default_model_path

    reader = GGUFReader(default_model_path())
    field = reader.fields
    tokens = list(field["tokenizer.ggml.tokens"].contents())
    types = list(field["tokenizer.ggml.token_type"].contents())
    pad = vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    # NORMAL, not UNUSED: llama.cpp detokenizes an UNUSED token to nothing, so a random model
    # that picks padding tokens would stream empty chunks there and text in everystop, and a
    # client timing content chunks would compare different things. No merge builds these
    # tokens, so text never tokenizes to them.
    types += [PADDING_TOKEN_TYPE] * pad
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
