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


def _resident_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total


def test_release_drops_a_read_tensors_pages_and_its_bytes_read_back_unchanged(
        tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    w = GGUFWriter(str(path), "llama")
    big = np.random.default_rng(1).standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB
    w.add_tensor("big", big)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = GGUFFile(str(path))
    (tensor,) = reader.tensors
    copy = np.array(tensor.data)  # what the loader does: its own copy, then release
    touched = _resident_kib(path)
    assert touched >= 4000  # the whole tensor was read in
    reader.release(tensor)
    assert _resident_kib(path) <= touched - 4000
    assert np.array_equal(tensor.data, copy) and np.array_equal(copy, big)
