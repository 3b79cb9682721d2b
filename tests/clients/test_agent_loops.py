"""Multi-turn tool-using agent loops as the libraries run them: every message the library hands
back (the openai SDK's `model_dump()`, LiteLLM's Message for its `openai/` and `hosted_vllm/`
providers) is sent again on the next turn, unchanged; and a forced call whose parameters are a
nested Pydantic model (`$defs`), through `pydantic_function_tool` + `.parse`."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def _tool_result(call: Any) -> dict[str, Any]:
    args = json.loads(call.function.arguments)
    return {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}


def test_openai_sdk_three_turn_tool_loop(base_url: str, model_name: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    first = client.chat.completions.create(model=model_name, messages=messages, tools=[ADD],
                                           tool_choice="required", temperature=0,
                                           max_tokens=40)
    reply = first.choices[0].message
    assert reply.tool_calls
    messages.append(reply.model_dump())  # refusal, audio, function_call: null, ...
    messages.extend(_tool_result(c) for c in reply.tool_calls)
    second = client.chat.completions.create(model=model_name, messages=messages, tools=[ADD],
                                            temperature=0, max_tokens=24)
    messages.append(second.choices[0].message.model_dump())
    messages.append({"role": "user", "content": "Thanks. And 4 + 4?"})
    third = client.chat.completions.create(model=model_name, messages=messages, tools=[ADD],
                                           tool_choice="required", temperature=0,
                                           max_tokens=40)
    assert third.choices[0].message.tool_calls


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_three_turn_tool_loop(base_url: str, model_name: str, provider: str) -> None:
    litellm = pytest.importorskip("litellm")
    kwargs = dict(model=f"{provider}/{model_name}", api_base=base_url, api_key="none",
                  temperature=0, tools=[ADD])
    messages: list[Any] = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    first = litellm.completion(messages=messages, tool_choice="required", max_tokens=40,
                               **kwargs)
    reply = first.choices[0].message
    assert reply.tool_calls
    messages.append(reply)  # LiteLLM's Message, provider_specific_fields and all
    messages.extend(_tool_result(c) for c in reply.tool_calls)
    second = litellm.completion(messages=messages, max_tokens=24, **kwargs)
    messages.append(second.choices[0].message)
    messages.append({"role": "user", "content": "Thanks. And 4 + 4?"})
    third = litellm.completion(messages=messages, tool_choice="required", max_tokens=40,
                               **kwargs)
    assert third.choices[0].message.tool_calls


class City(BaseModel):
    name: str
    country: str


class Trip(BaseModel):
    origin: City
    destination: City


def test_pydantic_function_tool_with_a_nested_model(base_url: str, model_name: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    tool = openai.pydantic_function_tool(Trip)
    assert "$defs" in json.dumps(tool["function"]["parameters"])
    out = client.chat.completions.parse(
        model=model_name, temperature=0, max_tokens=80, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "Trip"}},
        messages=[{"role": "user", "content": "Plan a trip from Paris, France to Rome, Italy."}])
    (call,) = out.choices[0].message.tool_calls or []
    trip = call.function.parsed_arguments
    assert isinstance(trip, Trip) and isinstance(trip.origin, City)
