"""16-bit KV caches against the fp32 cache on the default model: the same next-token choice
(top-1) at >= 99.5% of 32 prompts x 64 positions, teacher-forced on the fp32 run's tokens so one
early flip cannot cascade into a different continuation. Also what "auto" picks, and that the
pool's size and capacity line follow the cache dtype."""

from __future__ import annotations

import pytest
import torch

from everystop.config import CacheConfig, ModelConfig
from everystop.core.outputs import ScheduledSequence
from everystop.executor.model_runner import ModelRunner
from everystop.tokenizer import load_tokenizer

from .conftest import GREEDY, blocks_for, greedy_generate

NUM_PROMPTS, NUM_NEW, PER_SEQ = 32, 64, 8  # 8 blocks x 16 = 128 positions per sequence
TOPICS = ["the ocean", "volcanoes", "a chess opening", "bread baking", "the moon landing",
          "photosynthesis", "jazz", "a bicycle", "prime numbers", "the Roman empire",
          "honey bees", "a thunderstorm", "compilers", "coffee", "glaciers", "the violin",
          "a marathon", "black holes", "origami", "tea ceremonies", "electric cars", "owls",
          "the printing press", "sourdough", "coral reefs", "a lighthouse", "magnets",
          "the Sahara", "penguins", "a sailing boat", "rainbows", "the internet"]


def _runner(kv_dtype: str, blocks: int = NUM_PROMPTS * PER_SEQ) -> ModelRunner:
    # fp32 activations, as the reference runner's: only the cache dtype differs.
    return ModelRunner(ModelConfig(int8_decode_dot="off"),
                       CacheConfig(num_gpu_blocks_override=blocks, kv_cache_dtype=kv_dtype),
                       max_model_len=2048)


def _teacher_forced_top1(runner: ModelRunner, prompts: list[list[int]],
                         forced: list[list[int]]) -> list[list[int]]:
    """Feed prompt + forced tokens step by step; return the runner's argmax at each step."""
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    choices: list[list[int]] = [[] for _ in prompts]
    for step in range(len(forced[0])):
        seqs = [ScheduledSequence(str(i), tokens[i][computed[i]:], computed[i],
                                  blocks_for(i, PER_SEQ), True, GREEDY, output_index=step)
                for i in range(len(prompts))]
        _, logits = runner.forward_logits(seqs)
        assert logits is not None
        for i, best in enumerate(logits.argmax(dim=-1).tolist()):
            choices[i].append(best)
            computed[i] = len(tokens[i])
            tokens[i].append(forced[i][step])
    return choices


@pytest.fixture(scope="module")
def reference(default_runner: ModelRunner):
    """Prompts and the fp32-cache greedy continuation of each (on the session's float32-cache
    runner: its pool holds these prompts' blocks)."""
    assert default_runner.kv_dtype == torch.float32
    assert default_runner.num_gpu_blocks >= NUM_PROMPTS * PER_SEQ
    tok = load_tokenizer()
    prompts = [tok.encode(f"Write two sentences about {t}.") for t in TOPICS[:NUM_PROMPTS]]
    forced, _ = greedy_generate(default_runner, prompts, NUM_NEW, per_seq=PER_SEQ)
    return prompts, forced


@pytest.mark.model
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_16bit_cache_agrees_with_fp32_cache(reference, kv_dtype):
    prompts, forced = reference
    runner = _runner(kv_dtype)
    assert runner.kv_dtype == getattr(torch, kv_dtype)
    choices = _teacher_forced_top1(runner, prompts, forced)
    agree = sum(a == b for got, want in zip(choices, forced) for a, b in zip(got, want))
    total = NUM_PROMPTS * NUM_NEW
    assert agree / total >= 0.995, f"top-1 agreement {agree}/{total} with the fp32 cache"


@pytest.mark.model
def test_auto_is_16bit_with_kernels_and_model_dtype_without():
    with_kernels = _runner("auto", blocks=4)
    assert with_kernels.backends.kernels is not None
    assert with_kernels.kv_dtype == torch.float16
    assert "float16 (auto)" in with_kernels.describe_capacity()
    plain = ModelRunner(ModelConfig(cpu_kernels="off"),
                        CacheConfig(num_gpu_blocks_override=4), max_model_len=2048)
    assert plain.kv_dtype == torch.float32


@pytest.mark.model
def test_pool_bytes_follow_the_cache_dtype():
    budget = 64 << 20
    fp32 = ModelRunner(ModelConfig(), CacheConfig(kv_cache_memory=budget,
                                                  kv_cache_dtype="float32"), max_model_len=2048)
    fp16 = ModelRunner(ModelConfig(), CacheConfig(kv_cache_memory=budget,
                                                  kv_cache_dtype="float16"), max_model_len=2048)
    assert fp16.bytes_per_token * 2 == fp32.bytes_per_token
    assert fp16.num_gpu_blocks == 2 * fp32.num_gpu_blocks
    assert fp16.kv_caches[0][0].dtype == torch.float16
