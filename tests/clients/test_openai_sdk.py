"""The `openai` SDK as users call it: n choices, logprobs (chat and completions), streamed and
not, and a refused field surfacing as the SDK's BadRequestError."""

from __future__ import annotations

import openai
import pytest

pytestmark = [pytest.mark.model, pytest.mark.server]

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)


def test_chat_n_choices_with_logprobs(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=6,
                                       temperature=0, n=2, logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: same text
    assert r.usage.completion_tokens == 2 * len(r.choices[0].logprobs.content)
    for entry in r.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3
        # Greedy picks the most likely token, so it heads its own top list.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0 and bytes(entry.bytes or []).decode(errors="replace")
    assert "".join(e.token for e in r.choices[0].logprobs.content) == \
        r.choices[0].message.content


def test_chat_stream_n_matches_non_streamed(client: openai.OpenAI, model_name: str) -> None:
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=6,
                                          temperature=0)
    texts = ["", ""]
    usage = None
    for chunk in client.chat.completions.create(model=model_name, messages=MESSAGES,
                                                max_tokens=6, temperature=0, n=2, stream=True,
                                                stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert texts == [full.choices[0].message.content] * 2
    assert usage is not None and usage.completion_tokens == 2 * full.usage.completion_tokens


def test_completions_logprobs_streamed_and_not(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, prompt="The capital of France is", max_tokens=5, temperature=0,
              logprobs=2)
    full = client.completions.create(**kw)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == full.usage.completion_tokens
    assert "".join(lp.tokens) == full.choices[0].text
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert len(top) == 2 and max(top, key=top.get) == token
    streamed = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens or [])]
    assert tokens == lp.tokens


def test_completions_two_prompts_times_n(client: openai.OpenAI, model_name: str) -> None:
    r = client.completions.create(model=model_name, prompt=["One, two,", "Red, green,"],
                                  max_tokens=3, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text != r.choices[2].text == r.choices[3].text


def test_refused_field_is_a_bad_request_naming_it(client: openai.OpenAI,
                                                  model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=2,
                                  extra_body={"no_such_field": 1})
    assert "no_such_field" in str(err.value)
