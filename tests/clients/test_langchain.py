"""LangChain's `ChatOpenAI` pointed at the server: invoke and stream give the greedy text a
direct call gives, with token usage; `with_structured_output` returns the schema's object;
`bind_tools` returns tool calls."""

from __future__ import annotations

import httpx
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

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


class Animal(BaseModel):
    name: str = Field(max_length=24)
    legs: int
    habitat: str = Field(max_length=24)


@pytest.fixture(scope="module")
def roomy(base_url: str, model_name: str) -> ChatOpenAI:
    """Room for a JSON reply."""
    return ChatOpenAI(model=model_name, base_url=base_url, api_key="none", temperature=0,
                      max_tokens=120, max_retries=0, timeout=120)


def test_with_structured_output(roomy: ChatOpenAI) -> None:
    animal = roomy.with_structured_output(Animal, method="json_schema").invoke(
        "Describe an animal.")
    assert isinstance(animal, Animal) and animal.name


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return "sunny"


def test_bind_tools_returns_tool_calls(roomy: ChatOpenAI) -> None:
    bound = roomy.bind_tools([get_weather], tool_choice="any")
    msg = bound.invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


def test_bind_tools_parallel_calls(roomy: ChatOpenAI) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    # An earlier turn that called the tool for two cities at once: the model follows it.
    earlier = [HumanMessage("What is the weather in Rome and in Madrid?"),
               AIMessage("", tool_calls=[
                   {"name": "get_weather", "args": {"city": c}, "id": f"c{i}"}
                   for i, c in enumerate(("Rome", "Madrid"))]),
               ToolMessage("Sunny, 20 degrees.", tool_call_id="c0"),
               ToolMessage("Cloudy, 15 degrees.", tool_call_id="c1"),
               AIMessage("Rome: sunny, 20 degrees. Madrid: cloudy, 15."),
               HumanMessage("What is the weather in Paris and in London?")]
    msg = roomy.bind_tools([get_weather], tool_choice="any").invoke(earlier)
    assert [c["args"]["city"] for c in msg.tool_calls] == ["Paris", "London"]
    assert len({c["id"] for c in msg.tool_calls}) == 2
    single = roomy.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False)
    assert len(single.invoke(earlier).tool_calls) == 1
