"""The continuous-batching engine on the real default model.

Greedy outputs of many concurrent requests of mixed lengths must be token-for-token equal to
each request run alone, whatever the chunk size, block size, prefix caching or KV pressure.
"""

from __future__ import annotations

import pytest

from everystop import LLM, SamplingParams

pytestmark = pytest.mark.model

WORDS = ("the quick brown fox jumps over the lazy dog while a small model writes careful notes "
         "about trains stopping at every station and passengers boarding at each door").split()
NEW_TOKENS = 24


def _prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        length = 3 + (i * 37) % 120  # 3 .. 122 words, mixed
        out.append(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(length)))
    return out


# 16 mixed-length prompts: each concurrent run and the one-at-a-time reference is an engine run
# of ~10-30 s here (CI's budget); tests/engine/test_engine_preemption_model.py runs 64.
PROMPTS = _prompts(16)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each of the prompts run by itself (max_num_seqs=1): the reference."""
    llm = LLM(max_num_seqs=1, max_num_batched_tokens=512, enable_prefix_caching=False)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]


# Every pair of values of the three settings appears in some case (6 cases instead of all 12
# combinations: each is a ~20 s engine run, and a fault is almost always in one setting or the
# interaction of two).
@pytest.mark.parametrize(("chunk_size", "block_size", "prefix_caching"), [
    (16, 16, True), (16, 32, False), (64, 16, False), (64, 32, True), (512, 16, True),
    (512, 32, False)])
def test_concurrent_equals_alone(alone, chunk_size: int, block_size: int,
                                 prefix_caching: bool) -> None:
    llm = LLM(max_num_seqs=32, max_num_batched_tokens=512, chunk_size=chunk_size,
              block_size=block_size, enable_prefix_caching=prefix_caching)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == alone
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_prefix_cache_shared_system_prompt() -> None:
    system = " ".join(WORDS * 3)  # ~80 tokens shared by every request
    prompts = [system + " " + p for p in PROMPTS[:6]]
    plain = LLM(enable_prefix_caching=False)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(enable_prefix_caching=True, block_size=16)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 64 for o in rest)  # the system prompt's full blocks
    assert [first.token_ids] + [o.token_ids for o in rest] == expected


def test_static_padding_rows_leave_outputs_and_cache_intact(alone) -> None:
    """Static batches of 8 with mixed lengths: finished members are still computed (padding
    rows) until their batch drains; nobody's tokens change and every block comes back."""
    llm = LLM(scheduling="static", max_batch_size=8, max_num_seqs=8, enable_chunked_prefill=False,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    lengths = [4 + (i * 7) % (NEW_TOKENS - 3) for i in range(len(PROMPTS))]
    padding_rows: list[int] = []
    llm.engine.iteration_listeners.append(
        lambda rec, sched: padding_rows.append(rec.num_padding_tokens))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [ref[:n] for ref, n in zip(alone, lengths)]
    assert sum(padding_rows) > 0
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_a_tight_tpot_target_changes_the_schedule_not_the_tokens() -> None:
    """A 20 ms target on this CPU leaves prefill a few tokens per step beside decodes (plus the
    anti-starvation floor); greedy outputs stay those of the fixed budget."""
    runs = {}
    for target in (0.0, 20.0):
        llm = LLM(max_num_seqs=16, max_num_batched_tokens=512, tpot_target_ms=target,
                  aging_interval_s=1.0)
        beside_decodes: list[int] = []

        def on_iteration(rec, _, seen: list[int] = beside_decodes) -> None:
            if rec.num_decode_tokens:
                seen.append(rec.num_prefill_tokens)

        llm.engine.add_listeners(on_iteration)
        outs = llm.generate(PROMPTS[:16], GREEDY, use_tqdm=False)
        runs[target] = ([o.token_ids for o in outs], max(beside_decodes, default=0))
    assert runs[20.0][0] == runs[0.0][0]
    assert runs[20.0][1] < runs[0.0][1]
