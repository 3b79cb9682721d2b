"""The real server (`python -m everystop serve`, default SmolLM2-135M model) driven by the
official openai client. Few requests, few tokens: the whole module stays well under 2 minutes
on two CPU cores."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from .conftest import ServerProcess, start_model_server

pytestmark = [pytest.mark.model, pytest.mark.server]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_model_server(tmp_path_factory.mktemp("model"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def model_name(server: ServerProcess) -> str:
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_greedy_completion_streamed_equals_non_streamed(client: openai.OpenAI,
                                                        model_name: str) -> None:
    full = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12,
                                     temperature=0)
    text = full.choices[0].text
    assert text.strip() and full.usage.completion_tokens <= 12
    assert full.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_streaming_and_not(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "Say hello in one short sentence."}]
    full = client.chat.completions.create(model=model_name, messages=messages, max_tokens=16,
                                          temperature=0)
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("stop", "length")
    streamed = client.chat.completions.create(model=model_name, messages=messages,
                                              max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text


def test_token_id_prompt_matches_text_prompt(client: openai.OpenAI, model_name: str) -> None:
    ids = httpx.post(str(client.base_url.join("/tokenize")), json={"prompt": PROMPT},
                     timeout=10).json()["tokens"]
    by_text = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8,
                                        temperature=0)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=8,
                                       temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stop_string_cuts_text_and_is_not_returned(client: openai.OpenAI,
                                                   model_name: str) -> None:
    text = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=20,
                                     temperature=0, extra_body={"ignore_eos": True}
                                     ).choices[0].text
    mid = len(text) // 2
    stop = text[mid:mid + 3]
    expected = text[:text.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=20,
                                      temperature=0, stop=[stop], stream=stream,
                                      extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            got, reason = "".join(c.choices[0].text for c in chunks), \
                chunks[-1].choices[0].finish_reason
        else:
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (got, reason) == (expected, "stop")


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, model_name: str) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=model_name, prompt="Once upon a time",
                                         max_tokens=12, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first or sample(7) != first


def test_concurrent_streams_get_their_own_text(server: ServerProcess, model_name: str) -> None:
    prompts = [f"Write a word that rhymes with {w}:" for w in ("cat", "tree", "moon", "car",
                                                               "rain", "sun")]

    async def main() -> tuple[list[str], list[str]]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                timeout=60)

        async def streamed(p: str) -> str:
            s = await ac.completions.create(model=model_name, prompt=p, max_tokens=10,
                                            temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in s])

        async def whole(p: str) -> str:
            r = await ac.completions.create(model=model_name, prompt=p, max_tokens=10,
                                            temperature=0)
            return r.choices[0].text

        try:
            got = await asyncio.gather(*(streamed(p) for p in prompts))
            want = await asyncio.gather(*(whole(p) for p in prompts))
            return list(got), list(want)
        finally:
            await ac.close()

    got, want = asyncio.run(asyncio.wait_for(main(), 90))
    assert got == want
    assert len(set(want)) > 1  # different prompts, different answers: no crossed streams


def test_multibyte_text_streams_intact(client: openai.OpenAI, model_name: str) -> None:
    prompt = "Translate to Chinese and add an emoji: good morning ->"
    full = client.completions.create(model=model_name, prompt=prompt, max_tokens=16,
                                     temperature=0).choices[0].text
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=16,
                                            temperature=0, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == full and "\ufffd" not in streamed


def test_disconnect_aborts_and_frees_blocks(server: ServerProcess, model_name: str) -> None:
    before = server.metric("everystop:kv_cache_used_blocks")
    aborted = server.num_aborted()
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # NOTE: kept open; leaving a for-loop over it would close it
        frames = 0
        while frames < 3:
            frames += next(lines).startswith("data: {")
        assert server.metric("everystop:kv_cache_used_blocks") > before
    # Ended by the disconnect (aborted), not by its 200 tokens; the wait is long enough for a
    # loaded host, where a model step alone may take a good part of a second.
    closed_at = time.monotonic()
    while time.monotonic() - closed_at < 5.0:
        if server.metric("everystop:kv_cache_used_blocks") == before and \
                server.num_aborted() > aborted:
            break
        time.sleep(0.02)
    assert server.metric("everystop:kv_cache_used_blocks") == before
    assert server.num_aborted() == aborted + 1
