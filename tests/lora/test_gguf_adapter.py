"""LoRA adapters in llama.cpp's GGUF form: written here with the `gguf` package from the PEFT
adapters (as llama.cpp's convert_lora_to_gguf.py lays them out: A [r, in], B [out, r], Q/K
rows of B interleaved per head), served with the same weights and outputs as their PEFT
directories and as peft's PeftModel; what llama.cpp's form cannot say is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from safetensors.torch import load_file

from everystop.executor.lora.gguf_adapter import load_gguf_adapter
from everystop.executor.lora.peft_adapter import LoraLoadError, load_peft_adapter

from .conftest import (
    VOCAB,
    greedy_generate,
    make_runner,
    peft_reference,
    tiny_config,
    transformers,
)

SERVED = ("all7", "qv", "kod")  # llama.cpp's file has no rsLoRA flag: mlp_rs is not exported
GGUF_KINDS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
NUM_HEADS, NUM_KV_HEADS = 4, 2  # conftest's tiny_config
NUM_NEW = 16


def interleave_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's export order of a Q/K weight's rows: per head, (2, d/2) -> (d/2, 2)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_adapter(peft_dir: str, out: Path, dtype: str = "F32",
                       general_type: str = "adapter", extra: dict | None = None) -> Path:
    config = json.loads((Path(peft_dir) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(peft_dir) / "adapter_model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch="llama")
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    for key, value in (extra or {}).items():
        writer.add_array(key, value)
    for name, t in sorted(tensors.items()):
        parts = name.split(".")  # base_model.model.model.layers.{i}.{attn|mlp}.{proj}.lora_X.weight
        layer, proj, which = parts[4], parts[6], parts[7][-1].lower()
        w = t.numpy()
        if which == "b" and proj in ("q_proj", "k_proj"):
            w = interleave_rope_rows(w, NUM_HEADS if proj == "q_proj" else NUM_KV_HEADS)
        name = f"blk.{layer}.{GGUF_KINDS[proj]}.weight.lora_{which}"
        w = np.ascontiguousarray(w)
        if dtype == "F32":
            writer.add_tensor(name, w)
        elif dtype == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[dtype]
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def gguf_files(lora_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf")
    return {name: str(write_gguf_adapter(lora_dirs[1][name], root / f"{name}.gguf"))
            for name in SERVED}


def _args(base: str):
    return make_runner(base, {}).model.args


@pytest.mark.parametrize("name", SERVED)
def test_a_gguf_adapter_holds_its_peft_directorys_weights(lora_dirs, gguf_files, name):
    base, adapters = lora_dirs
    args = _args(base)
    ours = load_gguf_adapter(gguf_files[name], args, torch.float32, 64)
    peft = load_peft_adapter(adapters[name], args, torch.float32)
    assert (ours.rank, ours.scale) == (peft.rank, peft.scale)
    assert sorted(ours.pairs) == sorted(peft.pairs)
    for key, pair in peft.pairs.items():
        assert torch.equal(ours.pairs[key].a, pair.a) and torch.equal(ours.pairs[key].b, pair.b)


def test_the_q_rows_in_the_file_are_not_peft_order(lora_dirs, gguf_files):
    """The control for the test above: the file's own q rows differ from PEFT's, so matching
    PEFT means the loader put them back."""
    reader = gguf.GGUFReader(gguf_files["all7"])
    file_b = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight.lora_b")
    peft_b = load_file(str(Path(lora_dirs[1]["all7"]) / "adapter_model.safetensors"))[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert not np.array_equal(np.asarray(file_b.data).reshape(peft_b.shape), peft_b.numpy())


def test_gguf_adapters_generate_what_peft_does(lora_dirs, gguf_files):
    base, adapters = lora_dirs
    runner = make_runner(base, {name: gguf_files[name] for name in SERVED})
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (11,), generator=gen).tolist()
    ours, first = greedy_generate(runner, [prompt] * len(SERVED), list(range(len(SERVED))),
                                  NUM_NEW)
    for i, name in enumerate(SERVED):
        tokens, logits = peft_reference(base, adapters[name], prompt, NUM_NEW)
        assert ours[i] == tokens, name
        assert (first[i] - logits).abs().max().item() < 1e-4, name


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_a_16_bit_gguf_adapter_is_read(lora_dirs, tmp_path, dtype):
    base, adapters = lora_dirs
    path = write_gguf_adapter(adapters["qv"], tmp_path / "qv16.gguf", dtype)
    args = _args(base)
    ours = load_gguf_adapter(str(path), args, torch.float32, 64)
    peft = load_peft_adapter(adapters["qv"], args, torch.float32)
    for key, pair in peft.pairs.items():
        assert torch.allclose(ours.pairs[key].b, pair.b, rtol=1e-3, atol=1e-2)


def test_a_gguf_model_file_is_not_an_adapter(lora_dirs, tmp_path):
    base, adapters = lora_dirs
    path = write_gguf_adapter(adapters["qv"], tmp_path / "m.gguf", general_type="model")
    with pytest.raises(LoraLoadError, match=r"general\.type is 'model', not 'adapter'"):
        load_gguf_adapter(str(path), _args(base), torch.float32, 64)


def test_an_activated_lora_is_refused_by_name(lora_dirs, tmp_path):
    base, adapters = lora_dirs
    path = write_gguf_adapter(adapters["qv"], tmp_path / "a.gguf",
                              extra={gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS: [5, 6]})
    with pytest.raises(LoraLoadError, match=r"unsupported LoRA options "
                                            r"adapter\.alora\.invocation_tokens"):
        load_gguf_adapter(str(path), _args(base), torch.float32, 64)


def test_rank_above_the_maximum_is_refused(lora_dirs, gguf_files):
    with pytest.raises(LoraLoadError, match="rank 16 is above the maximum LoRA rank 8"):
        make_runner(lora_dirs[0], {"kod": gguf_files["kod"]}, max_lora_rank=8)


def test_an_adapter_of_another_base_names_the_tensor(gguf_files, tmp_path):
    transformers.LlamaForCausalLM(tiny_config(intermediate_size=96)).save_pretrained(tmp_path)
    args = _args(str(tmp_path))
    with pytest.raises(LoraLoadError, match=r"'blk\.0\.ffn_down\.weight\.lora_a' has shape "
                                            r"\(16, 128\), but this base model needs \(16, 96\)"):
        load_gguf_adapter(gguf_files["kod"], args, torch.float32, 64)


def test_a_non_lora_tensor_is_refused_by_name(lora_dirs, tmp_path):
    base = lora_dirs[0]
    src = tmp_path / "n.gguf"
    writer = gguf.GGUFWriter(str(src), arch="llama")
    writer.add_type("adapter")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 8.0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoraLoadError, match=r"'blk\.0\.attn_norm\.weight' is not a LoRA weight"):
        load_gguf_adapter(str(src), _args(base), torch.float32, 64)
