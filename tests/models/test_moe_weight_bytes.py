"""A decode step of a sparse MoE model reads only the experts its rows chose: the weight bytes
the model counts for one single-sequence step of a Q8_0 Qwen3-MoE GGUF lie within 1.3x of
the active parameters' bytes (the bound the MoE path must meet), computed here from the
file's own tensor sizes: every non-expert tensor whole, one embedding row, and top-k of each
layer's experts."""

from __future__ import annotations

import pytest
import torch

from everystop.config import CacheConfig, ModelConfig
from everystop.executor.model_runner import ModelRunner
from tests.executor.conftest import greedy_generate

from .moe_gguf import write_moe_gguf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
gguf = pytest.importorskip("gguf")

EXPERTS, TOP_K, LAYERS, VOCAB, PER_SEQ = 32, 2, 2, 256, 4


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_bytes")
    config = transformers.Qwen3MoeConfig(
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=64,
        norm_topk_prob=True, intermediate_size=96, head_dim=32, vocab_size=VOCAB,
        hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        eos_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(root / "hf")
    checkpoint = safetensors_torch.load_file(root / "hf" / "model.safetensors")
    write_moe_gguf(config, checkpoint, root / "model.gguf", "q8_0")
    return root / "model.gguf"


def _file_bytes(path) -> tuple[int, int]:
    """(active bytes of one token's pass, bytes of the whole file's tensors)."""
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    experts = sum(n for name, n in tensors.items() if "_exps." in name)
    active = total - experts - tensors["token_embd.weight"]
    active += tensors["token_embd.weight"] // VOCAB + experts * TOP_K // EXPERTS
    return active, total


def test_a_decode_step_reads_within_1_3x_of_the_active_bytes(q8_file):
    runner = ModelRunner(ModelConfig(model=str(q8_file), dtype="float32"),
                         CacheConfig(num_gpu_blocks_override=2 * PER_SEQ, swap_space_gib=0.0,
                                     kv_cache_dtype="float32"), 64)
    greedy_generate(runner, [[3, 14, 15, 92, 65]], 2, PER_SEQ)  # the last pass: one decode
    read = runner.weight_bytes_last_pass()
    active, total = _file_bytes(q8_file)
    print(f"decode step read {read} B; active {active} B; all weights {total} B")
    assert active * 0.95 <= read <= 1.3 * active
    assert read < 0.25 * total


def test_a_prefill_reads_more_experts_than_a_decode_step(q8_file):
    """Many tokens choose many experts: the count follows the routing, not a constant."""
    runner = ModelRunner(ModelConfig(model=str(q8_file), dtype="float32"),
                         CacheConfig(num_gpu_blocks_override=2 * PER_SEQ, swap_space_gib=0.0,
                                     kv_cache_dtype="float32"), 64)
    greedy_generate(runner, [list(range(40))], 1, PER_SEQ)
    prefill = runner.weight_bytes_last_pass()
    greedy_generate(runner, [[7, 8]], 2, PER_SEQ)
    assert prefill > 2 * runner.weight_bytes_last_pass()
