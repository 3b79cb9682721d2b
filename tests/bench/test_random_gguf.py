"""Random-weight GGUFs for speed runs: the MoE script's shape meets the issue's size band, and
the written file holds what both engines need (block types, a tokenizer whose padding decodes
to text in llama.cpp as in everystop)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from everystop.bench.random_gguf import (
    PADDING_TOKEN_TYPE,
    add_default_tokenizer,
    write_random_tensors,
)
from everystop.executor.models.loader import default_model_path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moe_shape_is_1_to_3b_total_and_0_3_to_0_6b_active_per_token() -> None:
    moe = _script("make_moe_gguf")
    specs = moe.tensors()
    total = sum(math.prod(shape) for _, shape in specs)
    # A token reads every dense matrix but its embedding row, and USED of the stacked experts.
    active = sum(math.prod(shape) * (moe.USED / moe.EXPERTS if "_exps." in name else 1)
                 for name, shape in specs if name != "token_embd.weight")
    assert 1e9 <= total <= 3e9
    assert 0.3e9 <= active <= 0.6e9
    experts = [shape for name, shape in specs if "_exps." in name]
    assert len(experts) == 3 * moe.LAYERS and all(s[0] == moe.EXPERTS for s in experts)
    # Q4_0 and Q8_0 blocks hold 32 values along a row.
    assert all(shape[-1] % 32 == 0 for _, shape in specs if len(shape) > 1)


def test_written_file_has_blocks_f32_routers_and_text_decoding_padding(tmp_path: Path) -> None:
    default_vocab = len(GGUFReader(default_model_path()).fields["tokenizer.ggml.tokens"].data)
    vocab = default_vocab + 8
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "qwen3moe")
    add_default_tokenizer(writer, vocab)
    specs = [("blk.0.ffn_gate_inp.weight", (4, 64)), ("blk.0.ffn_up_exps.weight", (4, 32, 64)),
             ("blk.0.attn_norm.weight", (64,)), ("output.weight", (vocab, 64))]
    assert write_random_tensors(writer, specs, "q4_0") == sum(math.prod(s) for _, s in specs)

    reader = GGUFReader(str(path))
    kinds = {t.name: (t.tensor_type, tuple(int(d) for d in reversed(t.shape)))
             for t in reader.tensors}
    assert kinds == {"blk.0.ffn_gate_inp.weight": (GGMLQuantizationType.F32, (4, 64)),
                     "blk.0.ffn_up_exps.weight": (GGMLQuantizationType.Q4_0, (4, 32, 64)),
                     "blk.0.attn_norm.weight": (GGMLQuantizationType.F32, (64,)),
                     "output.weight": (GGMLQuantizationType.Q4_0, (vocab, 64))}
    fields = reader.fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    assert len(tokens) == len(types) == vocab
    assert tokens[default_vocab:] == [f"<|unused_{i}|>" for i in range(8)]
    # llama.cpp prints an UNUSED (5) token as nothing; NORMAL (1) as its text.
    assert types[default_vocab:] == [PADDING_TOKEN_TYPE] * 8 == [1] * 8
    norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    assert np.array_equal(norm.data, np.ones(64, dtype=np.float32))


def test_everystop_decodes_a_padding_token_to_its_name(tmp_path: Path) -> None:
    from everystop.tokenizer import load_tokenizer

    default_vocab = len(GGUFReader(default_model_path()).fields["tokenizer.ggml.tokens"].data)
    path = tmp_path / "padded.gguf"
    writer = GGUFWriter(str(path), "llama")
    add_default_tokenizer(writer, default_vocab + 2)
    write_random_tensors(writer, [("output.weight", (default_vocab + 2, 32))], "q8_0")
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.decode([default_vocab + 1]) == "<|unused_1|>"

