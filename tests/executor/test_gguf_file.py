"""Our one-pass GGUF reader against the `gguf` package's reader, on a small file written by
the `gguf` package itself: same metadata (tokenizer arrays skipped), same tensors, bytes and
types, quantized ones included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from everystop.executor.models.gguf_file import GGUFFile


def _write(path: Path) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_array("general.tags", ["a", "bc"])
    w.add_token_list(["<s>", "hello", "wörld"] * 100)
    w.add_token_scores([0.5] * 300)
    w.add_eos_token_id(2)
    w.add_bool("general.flag", True)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("q8", quantize(q, GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_matches_the_gguf_package(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write(path)
    ours, ref = GGUFFile(str(path)), GGUFReader(str(path))
    expected = {k: f.contents() for k, f in ref.fields.items()
                if not k.startswith("GGUF.")
                and (not k.startswith("tokenizer.ggml.") or k.endswith("_id"))}
    assert ours.fields.keys() == expected.keys()
    for key, value in expected.items():
        assert ours.fields[key] == pytest.approx(value), key
    assert ours.fields["tokenizer.ggml.eos_token_id"] == 2
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.shape == list(b.shape) and a.tensor_type == b.tensor_type
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, np.asarray(b.data))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(str(path))
