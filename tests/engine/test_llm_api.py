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
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(len(lp.top) == 1 for lp in out.logprobs)
    assert out.outputs[0].logprobs == out.logprobs


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
        assert out.prompt_logprobs is not None
        assert [e.token_id for e in out.prompt_logprobs] == [ord(c) for c in prompt[1:]]
        assert all(e.logprob == -0.5 and len(e.top) == 1 for e in out.prompt_logprobs)
    plain = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
