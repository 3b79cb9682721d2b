"""Speculative decoding on the real default model: greedy output with `speculative="ngram"` is
token-for-token what plain greedy decoding gives, alone and in a 16-sequence batch, on prompts
whose answers copy their input (where prompt lookup proposes well)."""

from __future__ import annotations

import pytest

from everystop import LLM, SamplingParams
from everystop.sampling_params import StructuredOutput

from .free_draft import EveryProposal

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


def every_proposal(llm: LLM) -> LLM:
    """`llm` with every row sized to its cap: the sizing rule (core/spec_sizing.py, tested in
    tests/core/test_spec_sizing.py) prices proposals by the measured step cost, and in a batch
    of 8-16 rows on a loaded host it may size them all off; these tests are of what verified
    proposals emit, so they need them made."""
    llm.engine.scheduler.spec_sizer = EveryProposal()
    return llm


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = LLM(**OPTIONS, max_num_seqs=32)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_ngram_speculation_gives_the_plain_greedy_tokens(plain, max_num_seqs: int) -> None:
    llm = every_proposal(LLM(**OPTIONS, max_num_seqs=max_num_seqs, speculative="ngram",
                             num_speculative_tokens=4))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain
    stats = llm.engine.stats()
    # Copying prompts: prompt lookup proposes, and the model accepts some of it.
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    assert llm.engine.kv.pool.num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


# Everything else a request may ask for behaves as without speculation: on 8 of the prompts,
# one engine without and one with it, each request's tokens, logprobs, text and finish equal.
# Seeded sampling draws each position's token from (seed, output index), as plain decoding
# does, so even sampled output is the same token for token. Batch-invariant kernels: a 1+k-row
# pass then computes each row bit for bit as a 1-row decode does (otherwise the GEMM's blocking
# depends on the row count and float sums round differently: logprobs differ by ~1e-3).
FEATURES = {
    "seeded-sampling": dict(temperature=0.8, top_p=0.9, seed=17),
    "logprobs": dict(temperature=0.0, logprobs=3),
    # Mild: strong penalties steer the output away from every token seen, so nothing repeats
    # and prompt lookup has nothing to propose.
    "penalties": dict(temperature=0.0, presence_penalty=0.2, frequency_penalty=0.1,
                      repetition_penalty=1.05),
    "min-tokens-and-eos": dict(temperature=0.0, min_tokens=6, ignore_eos=False,
                               logit_bias={2: 3.0}),
    "stop-string": dict(temperature=0.0, stop=[" at ", "o'clock"]),
    # Sampled under a grammar: each verified position samples under its own mask.
    "seeded-structured-output": dict(
        temperature=0.8, seed=17, ignore_eos=False,
        structured_output=StructuredOutput("regex", r"[a-z' ]+ at [0-9]+ o'clock")),
}


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    options = dict(OPTIONS, max_num_seqs=8, batch_invariant=True)
    return LLM(**options), every_proposal(LLM(**options, speculative="ngram",
                                              num_speculative_tokens=4))


@pytest.mark.parametrize("feature", list(FEATURES))
def test_request_features_behave_as_without_speculation(engines, feature: str) -> None:
    params = SamplingParams(**{**dict(max_tokens=12, ignore_eos=True), **FEATURES[feature]})
    plain_llm, spec_llm = engines
    before = spec_llm.engine.stats()
    plain = plain_llm.generate(PROMPTS[:8], params, use_tqdm=False)
    spec = spec_llm.generate(PROMPTS[:8], params, use_tqdm=False)
    after = spec_llm.engine.stats()  # it speculated, and kept some
    assert after.spec_decode_num_draft_tokens > before.spec_decode_num_draft_tokens
    assert after.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and b.text == a.text
        assert b.finish_reason == a.finish_reason
        if params.logprobs:
            a_lp, b_lp = a.outputs[0].logprobs, b.outputs[0].logprobs
            assert a_lp is not None and b_lp is not None and len(b_lp) == len(a_lp) == 12
            for x, y in zip(a_lp, b_lp):  # {token id: Logprob}, chosen and top alternatives
                assert list(y) == list(x)
                for t in x:
                    assert y[t].logprob == pytest.approx(x[t].logprob, abs=1e-5)
    spec_llm.engine.scheduler.check_integrity()
    assert spec_llm.engine.kv.pool.num_used_blocks == 0
