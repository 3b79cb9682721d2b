"""Speculative decoding on the real default model: greedy output with `speculative="ngram"` is
token-for-token what plain greedy decoding gives, alone and in a 16-sequence batch, on prompts
whose answers copy their input (where prompt lookup proposes well)."""

from __future__ import annotations

import pytest

from everystop import LLM, SamplingParams

pytestmark = pytest.mark.model

SUBJECTS = ("the quick brown fox", "a tired old sailor", "my neighbour's cat", "the city council",
            "every morning train", "a careful student", "the red balloon", "our small garden")
VERBS = ("jumps over the lazy dog", "writes long letters home", "sleeps in the warm sun",
         "votes on the new budget")


def _prompt(i: int) -> str:
    sentence = f"{SUBJECTS[i % 8]} {VERBS[i // 8]} at {i + 2} o'clock"
    return (f"Copy each line.\nInput: birds sing in the tall trees\n"
            f"Output: birds sing in the tall trees\nInput: {sentence}\nOutput:")


PROMPTS = [_prompt(i) for i in range(32)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = LLM(**OPTIONS, max_num_seqs=32)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_ngram_speculation_gives_the_plain_greedy_tokens(plain, max_num_seqs: int) -> None:
    llm = LLM(**OPTIONS, max_num_seqs=max_num_seqs, speculative="ngram",
              num_speculative_tokens=4)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain
    stats = llm.engine.stats()
    # Copying prompts: prompt lookup proposes, and the model accepts some of it.
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    assert llm.engine.kv.pool.num_used_blocks == 0
    llm.engine.scheduler.check_integrity()
