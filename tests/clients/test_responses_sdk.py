"""The openai SDK's Responses API against the server: text, streaming, a function tool and a
structured-output format."""

from __future__ import annotations

import json

import openai

ADD = {"type": "function", "name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                       "b": {"type": "integer"}},
                      "required": ["a", "b"]}}


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)


def test_text_and_stream(base_url: str, model_name: str) -> None:
    client = _client(base_url)
    out = client.responses.create(model=model_name, input="Tell me the capital of France.",
                                  max_output_tokens=24, temperature=0, store=False)
    assert "Paris" in out.output_text
    with client.responses.stream(model=model_name, input="Tell me the capital of France.",
                                 max_output_tokens=24, temperature=0, store=False) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == out.output_text


def test_function_tool_call(base_url: str, model_name: str) -> None:
    out = _client(base_url).responses.create(
        model=model_name, input="What is 2 + 3? Use the add tool.", tools=[ADD],
        tool_choice="required", temperature=0, max_output_tokens=40)
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and calls[0].name == "add"
    assert set(json.loads(calls[0].arguments)) == {"a", "b"}


def test_json_schema_format(base_url: str, model_name: str) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    out = _client(base_url).responses.create(
        model=model_name, input="Name the capital of France as JSON.", temperature=0,
        max_output_tokens=40, text={"format": {"type": "json_schema", "name": "c",
                                               "schema": schema, "strict": True}})
    assert set(json.loads(out.output_text)) == {"city"}
