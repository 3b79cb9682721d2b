"""Adapters that cannot be served are refused at load with the reason by name; a pass with no
adapter rows runs exactly as without adapters (the decoder stack included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from everystop.config import ConfigError, ModelConfig
from everystop.core.outputs import ScheduledSequence
from everystop.executor.lora.peft_adapter import LoraLoadError, load_peft_adapter, peft_scale
from everystop.executor.models.decoder import DecoderForCausalLM

from .conftest import GREEDY, make_runner, save_adapter, tiny_config, transformers


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def _args(base: str):
    return make_runner(base, {}).model.args


def test_peft_scale_is_alpha_over_rank_or_its_square_root():
    assert peft_scale(16.0, 4, False) == 4.0
    assert peft_scale(16.0, 4, True) == 8.0


def test_rank_above_the_maximum_is_refused(lora_dirs):
    base, adapters = lora_dirs
    with pytest.raises(LoraLoadError, match=r"rank 16 is above the maximum LoRA rank 8"):
        make_runner(base, {"kod": adapters["kod"]}, max_lora_rank=8)


def test_adapter_of_another_base_names_the_tensor_and_shapes(lora_dirs, tmp_path):
    base, _ = lora_dirs
    other = transformers.LlamaForCausalLM(tiny_config(hidden_size=32, intermediate_size=64))
    other_dir = str(tmp_path / "other")
    other.save_pretrained(other_dir)
    save_adapter(other_dir, str(tmp_path / "wrong"), 1, r=4, lora_alpha=8,
                 target_modules=["q_proj"])
    with pytest.raises(LoraLoadError, match=r"q_proj\.lora_A\.weight' has shape \(4, 32\), "
                                            r"but this base model needs \(4, 64\)"):
        load_peft_adapter(str(tmp_path / "wrong"), _args(base), torch.float32)


@pytest.mark.parametrize("option,value", [("use_dora", True), ("modules_to_save", ["lm_head"]),
                                          ("bias", "all"), ("fan_in_fan_out", True),
                                          ("rank_pattern", {"q_proj": 2})])
def test_options_that_change_the_arithmetic_are_refused_by_name(lora_dirs, tmp_path, option,
                                                                value):
    base, adapters = lora_dirs
    path = _copy(adapters["qv"], tmp_path / "a")
    _edit_config(path, **{option: value})
    with pytest.raises(LoraLoadError, match=f"unsupported LoRA options {option}="):
        load_peft_adapter(str(path), _args(base), torch.float32)


def test_a_tensor_for_an_untargetable_module_is_refused(lora_dirs, tmp_path):
    base, adapters = lora_dirs
    path = _copy(adapters["qv"], tmp_path / "a")
    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
    save_file(tensors, str(file))
    with pytest.raises(LoraLoadError, match=r"lm_head\.lora_A\.weight' is not a LoRA weight"):
        load_peft_adapter(str(path), _args(base), torch.float32)


def test_missing_files_and_bad_json_are_named(lora_dirs, tmp_path):
    base, adapters = lora_dirs
    args = _args(base)
    with pytest.raises(LoraLoadError, match=r"cannot read adapter_config\.json"):
        load_peft_adapter(str(tmp_path), args, torch.float32)
    path = _copy(adapters["qv"], tmp_path / "a")
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraLoadError, match="not JSON"):
        load_peft_adapter(str(path), args, torch.float32)


def test_duplicate_adapter_names_are_a_config_error():
    with pytest.raises(ConfigError, match="distinct"):
        ModelConfig(lora_modules=(("a", "/x"), ("a", "/y")))


def _decode_rows(lora_ids: list[int]) -> list[ScheduledSequence]:
    return [ScheduledSequence(str(i), [3 + i], 4, [i], True, GREEDY, output_index=1,
                              lora_id=lora_id) for i, lora_id in enumerate(lora_ids)]


def test_decode_without_adapter_rows_takes_the_decoder_stack(lora_dirs, monkeypatch):
    base, adapters = lora_dirs
    runner = make_runner(base, {"qv": adapters["qv"]})
    if runner.backends.kernels is None:
        pytest.skip("no CPU kernels built here: there is no decoder stack to take")
    calls: list[bool] = []
    original = DecoderForCausalLM._decoder_stack

    def spy(self, *a, **k):
        calls.append(self.lora_bank.current is None)
        return original(self, *a, **k)

    monkeypatch.setattr(DecoderForCausalLM, "_decoder_stack", spy)
    runner.forward_logits(_decode_rows([-1, -1]))
    assert calls == [True]  # the stack ran, with no LoRA pass set
    runner.forward_logits(_decode_rows([-1, 0]))
    assert calls == [True, False]  # adapter rows: the stack too, with the LoRA pass set
