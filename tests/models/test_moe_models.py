"""Mixtral and Qwen3-MoE, tiny and random, built here by transformers, saved as safetensors and
as GGUF (llama.cpp's layout, F16 and Q8_0), loaded by everystop and compared with transformers
computing with the very values each file holds: prompt logits within LOGIT_ATOL, 32 greedy
tokens equal, and a packed batch equal to each prompt alone.

Observed on CPU float32 (AVX-512 kernels): max |logit diff| vs transformers ~1e-5."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from everystop.config import CacheConfig, ModelConfig
from everystop.core.outputs import ScheduledSequence
from everystop.executor.layers.cpu_kernels import CpuKernels
from everystop.executor.layers.moe import SparseMoeBlock, route
from everystop.executor.model_runner import ModelRunner
from everystop.executor.models.loader import load_model
from tests.executor.conftest import GREEDY, blocks_for, greedy_generate
from tests.executor.test_moe_layer import poison_unchosen

from .moe_gguf import write_moe_gguf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LOGIT_ATOL = 1e-3
NUM_NEW = 32
PER_SEQ = 16  # blocks of 16 tokens per sequence: 256 positions >= 200 + 32
VOCAB = 256

CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
        intermediate_size=96, head_dim=32),
    # Weights left as the softmax gave them, and a dense layer among the MoE ones.
    "qwen3_moe_unnormalized": lambda: transformers.Qwen3MoeConfig(
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=False,
        intermediate_size=96, head_dim=32, mlp_only_layers=[1]),
}
SOURCES = ("safetensors", "f16", "q8_0")
_ARCH = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _tiny(name: str):
    config = CONFIGS[name]()
    for key, value in dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, rms_norm_eps=1e-5, eos_token_id=None,
                           bos_token_id=None, tie_word_embeddings=False).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = getattr(transformers, _ARCH[config.model_type])(config)
    # Larger weights than the default init, so logits and routing are far from ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model.eval()


@pytest.fixture(scope="module", params=[(m, s) for m in CONFIGS for s in SOURCES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tmp_path_factory):
    """(everystop's runner, the transformers model computing with the same values)."""
    name, source = request.param
    root = tmp_path_factory.mktemp(f"{name}-{source}")
    model = _tiny(name)
    hf_dir = root / "hf"
    model.save_pretrained(hf_dir, safe_serialization=True)
    if source == "safetensors":
        path, reference = hf_dir, model
    else:
        checkpoint = safetensors_torch.load_file(hf_dir / "model.safetensors")
        path = root / f"model-{source}.gguf"
        held = write_moe_gguf(model.config, checkpoint, path, source)
        reference = _reference_with(held, hf_dir, root / "as_held")
    # fp32 activations, none rounded to int8 for the Q8_0 weights: an exact comparison.
    runner = ModelRunner(ModelConfig(model=str(path), dtype="float32", int8_decode_dot="off"),
                         CacheConfig(num_gpu_blocks_override=8 * PER_SEQ, swap_space_gib=0.0,
                                     kv_cache_dtype="float32"), 512)
    return runner, reference


def _reference_with(state: dict[str, torch.Tensor], hf_dir: Path, out: Path):
    """A transformers model loaded from `state` (checkpoint names) with hf_dir's config."""
    out.mkdir()
    shutil.copy(hf_dir / "config.json", out / "config.json")
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()},
                                out / "model.safetensors", metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 60, 200)]


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        res = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return res.sequences[0, len(prompt):].tolist(), res.logits[0][0].float()


def test_logits_and_greedy_tokens_match_transformers(pair):
    runner, hf = pair
    prompts = _prompts()
    ours, first = greedy_generate(runner, prompts, NUM_NEW, PER_SEQ)
    worst = 0.0
    for i, prompt in enumerate(prompts):
        theirs, their_first = _hf_greedy(hf, prompt)
        diff = (first[i] - their_first).abs().max().item()
        worst = max(worst, diff)
        assert diff < LOGIT_ATOL, f"prompt {i}: first-step logits differ by {diff}"
        assert ours[i] == theirs, f"prompt {i}"
    print(f"max |logit diff| vs transformers: {worst:.2e}")


def test_decode_runs_the_experts_in_the_cpp_stack_and_matches_transformers(pair, monkeypatch):
    """Decode steps take the C++ decoder stack with the MoE layers inside it (router, top-k and
    the chosen experts in csrc/moe_experts.cpp), and the tokens are still transformers'."""
    runner, hf = pair
    moes = []
    stack = CpuKernels.decoder_stack

    def spy(self, *args, **kwargs):
        moes.append(kwargs.get("moe"))
        return stack(self, *args, **kwargs)

    monkeypatch.setattr(CpuKernels, "decoder_stack", spy)
    prompts = _prompts()[:2]
    ours, _ = greedy_generate(runner, prompts, 8, PER_SEQ)
    assert len(moes) >= 7  # the 7 decode steps (the 8-row first step may take it too)
    assert all(moe is not None and int(moe.chosen.sum()) > 0 for moe in moes)
    for i, prompt in enumerate(prompts):
        assert ours[i] == _hf_greedy(hf, prompt)[0][:8], f"prompt {i}"


def test_packed_batch_equals_each_alone(pair):
    runner, _ = pair
    prompts = _prompts()
    packed_tokens, packed = greedy_generate(runner, prompts, 4, PER_SEQ)
    for i, prompt in enumerate(prompts):
        alone_tokens, alone = greedy_generate(runner, [prompt], 4, PER_SEQ)
        assert (packed[i] - alone[0]).abs().max().item() < LOGIT_ATOL
        assert packed_tokens[i] == alone_tokens[0]


def test_config_json_is_what_the_test_says(tmp_path):
    """The unnormalized case really turns renormalization off and keeps a dense layer."""
    model = _tiny("qwen3_moe_unnormalized")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["norm_topk_prob"] is False and config["mlp_only_layers"] == [1]


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen3_moe_q8_0")
    model = _tiny("qwen3_moe")
    model.save_pretrained(root / "hf", safe_serialization=True)
    checkpoint = safetensors_torch.load_file(root / "hf" / "model.safetensors")
    write_moe_gguf(model.config, checkpoint, root / "model.gguf", "q8_0")
    return root / "model.gguf"


def test_q8_0_experts_are_held_as_the_file_stores_them(q8_gguf):
    from gguf import GGUFReader

    experts = load_model(str(q8_gguf)).model.layers[1].mlp.experts
    tensors = {t.name: np.array(t.data) for t in GGUFReader(str(q8_gguf)).tensors}
    gate, up, down = (tensors[f"blk.1.ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
    assert experts.gate_up_proj.weight_format == experts.down_proj.weight_format == "q8_0"
    # Expert-major [gate_e; up_e], each the file's bytes.
    stacked = np.concatenate([gate, up], axis=1).reshape(-1, gate.shape[-1])
    assert torch.equal(experts.gate_up_proj.weight, torch.from_numpy(stacked))
    assert torch.equal(experts.down_proj.weight, torch.from_numpy(down.reshape(-1, down.shape[-1])))


def test_a_decode_step_reads_only_the_experts_its_rows_chose(q8_gguf, tmp_path, monkeypatch):
    """Decode two sequences one step; poison (NaN) every expert no row chose in that step, in
    every layer; the same step again, in the C++ decoder stack, gives bit-identical logits.
    (The choices are seen by hooks on the layer-by-layer blocks, routing their inputs as the
    stack does.)"""
    path = tmp_path / "own.gguf"  # a copy: the runner's loaded model is ours alone to poison
    shutil.copy(q8_gguf, path)
    runner = ModelRunner(ModelConfig(model=str(path), dtype="float32"),
                         CacheConfig(num_gpu_blocks_override=4 * PER_SEQ, swap_space_gib=0.0,
                                     kv_cache_dtype="float32"), 512)
    prompts = _prompts()[1:3]
    greedy_generate(runner, prompts, 1, PER_SEQ)  # the prompts' K/V
    step = [ScheduledSequence(str(i), [5 + i], len(p), blocks_for(i, PER_SEQ), True, GREEDY,
                              output_index=1) for i, p in enumerate(prompts)]
    model = runner.model
    stacked = model.backends
    model.backends = dataclasses.replace(stacked, decoder_stack=False)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    chosen: dict[int, set[int]] = {}
    hooks = [b.register_forward_hook(
        lambda mod, inp, out, i=i: chosen.setdefault(i, set()).update(
            route(mod.gate(inp[0]), mod.top_k, mod.renormalize)[1].flatten().tolist()))
        for i, b in enumerate(blocks)]
    _, clean = runner.forward_logits(step)
    for h in hooks:
        h.remove()
    model.backends = stacked
    stack_calls = []
    stack = CpuKernels.decoder_stack
    monkeypatch.setattr(CpuKernels, "decoder_stack",
                        lambda *a, **k: stack_calls.append(1) or stack(*a, **k))
    poisoned = sum(poison_unchosen(b, chosen[i]) for i, b in enumerate(blocks))
    assert poisoned >= len(blocks)  # 2 rows x 4 of 16 experts: most go unread
    _, again = runner.forward_logits(step)
    assert stack_calls and not clean.isnan().any()
    assert torch.equal(again, clean)


def test_tensor_parallel_2_matches_1(tmp_path):
    """Two ranks, each with half of every expert's intermediate size: the same greedy tokens
    and first-step logits as one process (tests/executor/test_tensor_parallel.py's check)."""
    from everystop.executor.models.loader import default_model_path
    from tests.executor.test_tensor_parallel import _compare

    _tiny("qwen3_moe").save_pretrained(tmp_path, safe_serialization=True)
    _compare(str(tmp_path), default_model_path(), vocab=VOCAB)


def test_bfloat16_activations_follow_float32(q8_gguf):
    """The same Q8_0 file run with bf16 activations: finite logits near fp32's."""
    logits = []
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(ModelConfig(model=str(q8_gguf), dtype=dtype),  # type: ignore[arg-type]
                             CacheConfig(num_gpu_blocks_override=8 * PER_SEQ, swap_space_gib=0.0,
                                         kv_cache_dtype="float32"), 512)
        logits.append(greedy_generate(runner, _prompts(), 1, PER_SEQ)[1])
    fp32, bf16 = logits
    assert bf16.isfinite().all()
    scale = fp32.abs().max().item()
    assert (bf16 - fp32).abs().max().item() < 0.05 * scale
