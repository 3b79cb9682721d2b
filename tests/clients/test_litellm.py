"""LiteLLM's `openai/` provider pointed at the server: the same greedy text as a direct call,
non-streamed and streamed, and the usage it reports."""

from __future__ import annotations

import httpx
import litellm
import pytest

pytestmark = [pytest.mark.model, pytest.mark.server]

MESSAGES = [{"role": "user", "content": "Name a fruit."}]


def _direct(base_url: str, model_name: str) -> dict:
    r = httpx.post(base_url + "/chat/completions", timeout=120, json={
        "model": model_name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_and_stream(base_url: str, model_name: str) -> None:
    expected = _direct(base_url, model_name)
    kw = dict(model=f"openai/{model_name}", api_base=base_url, api_key="none",
              messages=MESSAGES, max_tokens=8, temperature=0)
    r = litellm.completion(**kw)
    assert r.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert r.usage.completion_tokens == expected["usage"]["completion_tokens"]
    assert r.choices[0].finish_reason == expected["choices"][0]["finish_reason"]
    parts = [c.choices[0].delta.content or "" for c in litellm.completion(**kw, stream=True)]
    assert "".join(parts) == expected["choices"][0]["message"]["content"]
