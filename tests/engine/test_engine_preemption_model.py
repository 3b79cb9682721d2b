"""Preemption on the real default model: 32 concurrent greedy requests in a KV pool far too
small for them (40 blocks of 16 tokens for 180 blocks of demand) give the same tokens as with
ample memory, by recompute, swap or either.

(Apart from tests/engine/test_engine_model.py so that CI's two workers can run them side by side.)
"""

from __future__ import annotations

import pytest

from everystop import LLM

from .test_engine_model import GREEDY, _prompts

pytestmark = pytest.mark.model

ALL_PROMPTS = _prompts(32)  # 64 took ~40 s per mode in CI; 32 still need 4.5x the pool


@pytest.fixture(scope="module")
def ample() -> list[list[int]]:
    """All the prompts at once with ample KV memory: the reference for the starved runs."""
    llm = LLM(max_num_seqs=64, max_num_batched_tokens=1024, enable_prefix_caching=False)
    outs = [o.token_ids for o in llm.generate(ALL_PROMPTS, GREEDY, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions == {"recompute": 0, "swap": 0}
    return outs


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_kv_starved_engine_preempts_and_matches(ample, mode: str) -> None:
    """A pool far smaller than the load needs: 32 concurrent greedy requests still give the same
    tokens as with ample memory, preemptions happen, and the pool ends whole."""
    llm = LLM(max_num_seqs=64, max_num_batched_tokens=512, block_size=16,
              num_gpu_blocks_override=40, swap_space_gib=0.05, preemption_mode=mode,
              recompute_threshold_tokens=32, enable_prefix_caching=False)
    outs = llm.generate(ALL_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ample
    sched = llm.engine.scheduler
    total = sched.num_preemptions["recompute"] + sched.num_preemptions["swap"]
    assert total > 0
    if mode == "swap":
        assert sched.num_preemptions["swap"] > 0 and sched.num_swap_in_blocks > 0
    if mode == "recompute":
        assert sched.num_preemptions["swap"] == 0
    assert llm.engine.kv.pool.num_used_blocks == 0 and llm.engine.kv.num_swapped_blocks == 0
    llm.engine.scheduler.check_integrity()
