"""The model's sliding window flows from its config.json through the executor to the engine's
KV cache manager: a window every layer honours reaches it; a model with any global layer (or
none at all) passes None, and the cache keeps every block."""

from __future__ import annotations

import pytest
import torch

from everystop.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from everystop.engine.llm_engine import LLMEngine
from everystop.executor.executor import LocalExecutor
from everystop.executor.models.registry import family_for_hf
from everystop.sampling_params import SamplingParams
from tests.core.toy_executor import ToyExecutor, reference_output
from tests.engine.toy_engine import CharTokenizer

transformers = pytest.importorskip("transformers")


MISTRAL, QWEN2 = ["MistralForCausalLM"], ["Qwen2ForCausalLM"]


@pytest.mark.parametrize(("config", "window"), [
    ({"architectures": MISTRAL, "sliding_window": 64}, 64),
    ({"architectures": MISTRAL, "sliding_window": None}, None),
    ({"architectures": ["LlamaForCausalLM"]}, None),
    ({"architectures": QWEN2, "sliding_window": 4096, "use_sliding_window": False}, None),
    ({"architectures": QWEN2, "sliding_window": 4096, "use_sliding_window": True,
      "max_window_layers": 28}, None),
    ({"architectures": QWEN2, "sliding_window": 4096, "use_sliding_window": True,
      "max_window_layers": 0}, 4096),
    ({"architectures": MISTRAL, "sliding_window": 512,  # a local layer, then a global one
      "layer_types": ["sliding_attention", "full_attention"]}, None),
    ({"architectures": MISTRAL, "sliding_window": 512,
      "layer_types": ["sliding_attention"] * 2}, 512),
])
def test_the_window_every_layer_honours(config: dict, window: int | None) -> None:
    full = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, **config)
    assert family_for_hf(full, "test").hf_args(full).sliding_window == window


def _tiny_model_dir(tmp_path, family: str) -> str:
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common,
                                                                          sliding_window=32))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


@pytest.mark.parametrize(("family", "window"), [("mistral", 32), ("llama", None)])
def test_a_model_config_hands_its_window_to_the_kv_cache(tmp_path, family: str,
                                                         window: int | None) -> None:
    model = ModelConfig(model=_tiny_model_dir(tmp_path, family))
    cache = CacheConfig(num_gpu_blocks_override=64, swap_space_gib=0.0)
    executor = LocalExecutor(model, cache, None)
    assert executor.sliding_window == window
    config = EngineConfig(model=model, cache=cache,
                          scheduler=SchedulerConfig(max_model_len=executor.max_model_len))
    kv = LLMEngine(config, executor, CharTokenizer()).kv
    assert kv.sliding_window == window
    if window is None:
        assert kv.null_block is None and kv.num_gpu_blocks == 64
    else:  # the device's last block stands for released entries
        assert kv.null_block is not None and kv.null_block.block_id == 63
        assert kv.num_gpu_blocks == 63


def test_an_engine_over_a_windowed_executor_releases_as_it_runs() -> None:
    config = EngineConfig(cache=CacheConfig(block_size=4, watermark=0.0),
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8,
                                                    chunk_size=8, max_model_len=4096))
    engine = LLMEngine(config, ToyExecutor(12, 4, sliding_window=8), CharTokenizer())
    prompt = list(range(40, 140))  # 25 blocks of prompt alone, in an 11-block pool
    engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                       request_id="long")
    tokens: list[int] = []
    while engine.scheduler.has_unfinished:
        for out in engine.step():
            tokens = list(out.token_ids)
        # The window's 8 positions and an 8-token chunk: 15 positions, at most 5 blocks.
        assert engine.kv.pool.num_used_blocks <= engine.kv.max_blocks_held(160, 8) == 5
    assert tokens == reference_output(prompt, 60, 8)
