"""The offline `LLM` API over the toy engine: vLLM's prompt shapes, n completions, and a
logprob entry for every generated token."""

from __future__ import annotations

import pytest

from everystop.config import CacheConfig, EngineConfig, SchedulerConfig
from everystop.engine.llm import LLM
from everystop.engine.llm_engine import LLMEngine
from everystop.sampling_params import SamplingParams
from tests.core.toy_executor import reference_output
from tests.engine.toy_engine import CharTokenizer
from tests.server.fakes import SlowToyExecutor


def toy_llm() -> LLM:
    config = EngineConfig(cache=CacheConfig(block_size=4, watermark=0.0),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                    chunk_size=16))
    return LLM.from_engine(LLMEngine(config, SlowToyExecutor(256, 4), CharTokenizer()))


def expected(prompt: str, n: int) -> list[int]:
    return reference_output([ord(c) for c in prompt], n)


def test_every_generated_token_has_its_logprob() -> None:
    out = toy_llm().generate("Hi", SamplingParams(max_tokens=5, logprobs=1, ignore_eos=True),
                             use_tqdm=False)[0]
    assert out.token_ids == expected("Hi", 5)
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == 5
    # vLLM's shape: per token, {token id: Logprob}, the sampled token among them.
    assert all(tid in entry for tid, entry in zip(out.token_ids, logprobs))
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(entry[tid].logprob for tid, entry in zip(out.token_ids, logprobs)))
    plain = toy_llm().generate("Hi", SamplingParams(max_tokens=5), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_vllm_style_post_processing_runs_unchanged() -> None:
    """Code written against vLLM's RequestOutput/CompletionOutput, as it reads them."""
    params = SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    outs = toy_llm().generate(["Hello", "Hi"], params, use_tqdm=False)
    for out in outs:
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        for tid, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            assert entry is not None and entry[tid].decoded_token == chr(tid)
        for completion in out.outputs:
            total = 0.0
            assert completion.logprobs is not None
            for tid, entry in zip(completion.token_ids, completion.logprobs):
                chosen = entry[tid]
                assert chosen.rank is not None and chosen.rank >= 1
                total += chosen.logprob
            assert completion.cumulative_logprob == pytest.approx(total)
            assert completion.finish_reason == "length" and completion.stop_reason is None


def test_stop_reason_names_the_stop_string_or_token() -> None:
    llm = toy_llm()
    text = "".join(chr(t) for t in expected("Hi", 8))
    by_string = llm.generate("Hi", SamplingParams(max_tokens=8, stop=[text[3:5]]),
                             use_tqdm=False)[0].outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", text[3:5])
    by_token = llm.generate("Hi", SamplingParams(max_tokens=8, stop_token_ids=[ord(text[2])]),
                            use_tqdm=False)[0].outputs[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", ord(text[2]))


@pytest.mark.parametrize("prompt", [{"prompt": "Hi"}, {"prompt_token_ids": [72, 105]}])
def test_dict_prompts_like_vllm(prompt: dict[str, object]) -> None:
    llm = toy_llm()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for outs in (llm.generate([prompt], params, use_tqdm=False),
                 llm.generate(prompt, params, use_tqdm=False)):
        assert len(outs) == 1 and outs[0].token_ids == expected("Hi", 4)
        assert outs[0].prompt_token_ids == [72, 105]
    assert llm.generate({"prompt": "Hi"}, params, use_tqdm=False)[0].prompt == "Hi"
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"text": "Hi"}, params, use_tqdm=False)


def test_n_completions_per_prompt() -> None:
    outs = toy_llm().generate(["ab", "cd"], SamplingParams(max_tokens=3, n=3, ignore_eos=True),
                              use_tqdm=False)
    assert len(outs) == 2
    for prompt, out in zip(["ab", "cd"], outs):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == expected(prompt, 3) for c in out.outputs)
        assert out.text == out.outputs[0].text


def test_prompt_logprobs_cover_every_prompt_token_across_chunks_and_skip_the_cache() -> None:
    llm = toy_llm()  # chunk_size 16: a 40-token prompt is scored in three chunks
    prompt = "".join(chr(65 + i % 26) for i in range(40))
    params = SamplingParams(max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    for _ in range(2):  # the second run would hit the prefix cache; it must not
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        scored = out.prompt_logprobs[1:]
        assert [ord(c) in e for c, e in zip(prompt[1:], scored) if e] == [True] * 39
        assert all(e is not None and e[ord(c)].logprob == -0.5
                   for c, e in zip(prompt[1:], scored))
    plain = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
