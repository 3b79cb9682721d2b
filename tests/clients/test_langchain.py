"""LangChain's `ChatOpenAI` pointed at the server: invoke and stream give the greedy text a
direct call gives, with token usage."""

from __future__ import annotations

import httpx
import pytest
from langchain_openai import ChatOpenAI

pytestmark = [pytest.mark.model, pytest.mark.server]

QUESTION = "Name an animal."


@pytest.fixture(scope="module")
def llm(base_url: str, model_name: str) -> ChatOpenAI:
    return ChatOpenAI(model=model_name, base_url=base_url, api_key="none", temperature=0,
                      max_tokens=8, max_retries=0, timeout=120)


def test_invoke_and_stream(llm: ChatOpenAI, base_url: str, model_name: str) -> None:
    direct = httpx.post(base_url + "/chat/completions", timeout=120, json={
        "model": model_name, "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8, "temperature": 0}).json()
    text = direct["choices"][0]["message"]["content"]
    msg = llm.invoke(QUESTION)
    assert msg.content == text
    assert msg.usage_metadata["output_tokens"] == direct["usage"]["completion_tokens"]
    assert msg.response_metadata["model_name"] == model_name
    assert "".join(str(chunk.content) for chunk in llm.stream(QUESTION)) == text
