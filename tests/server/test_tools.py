"""Tool calling's pieces without a model: the grammar for tool_choice, parsing calls out of
text, the request checks, and the template fallback that puts tools in the system turn."""

from __future__ import annotations

import json

import pytest

from everystop.server.errors import APIError
from everystop.server.protocol import ChatCompletionRequest, parse_body
from everystop.server.tools import parse_tool_calls, tool_constraint

ADD = {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
NOW = {"name": "now"}


def test_constraint_is_one_call_of_the_allowed_functions() -> None:
    required = tool_constraint([ADD, NOW], "required")
    assert required is not None and required.kind == "json_schema"
    schemas = json.loads(required.spec)["anyOf"]
    assert [s["properties"]["name"]["const"] for s in schemas] == ["add", "now"]
    assert schemas[0]["properties"]["arguments"] == ADD["parameters"]
    named = tool_constraint([ADD, NOW], "now")
    assert named is not None and json.loads(named.spec)["properties"]["name"] == {"const": "now"}
    assert tool_constraint([ADD], None) is None


@pytest.mark.parametrize("text", [
    '{"name": "add", "arguments": {"a": 1, "b": 2}}',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    ' {"name": "add", "parameters": {"a": 1, "b": 2}}',  # Llama 3.1's key
])
def test_calls_are_parsed_into_openai_shape(text: str) -> None:
    (call,) = parse_tool_calls(text, {"add"}) or []
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}


@pytest.mark.parametrize("text", ["The answer is 3.", '{"name": "sub", "arguments": {}}',
                                  '{"a": 1}', "<tool_call>{oops</tool_call>"])
def test_anything_else_is_content(text: str) -> None:
    assert parse_tool_calls(text, {"add"}) is None


def _chat(**extra: object) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "2 + 3?"}], **extra}
    return parse_body(json.dumps(body).encode(), ChatCompletionRequest)  # type: ignore[no-any-return]


def test_tool_choice_checks() -> None:
    tools = [{"type": "function", "function": ADD}]
    named = {"type": "function", "function": {"name": "add"}}
    so = _chat(tools=tools, tool_choice=named).structured_output()
    assert so is not None and so[0] == "tool_choice"
    assert _chat(tools=tools, tool_choice="auto").structured_output() is None
    assert _chat(tools=tools, tool_choice="none").tool_names() is None
    for bad, param in [(dict(tool_choice="required"), "tool_choice"),
                       (dict(tools=tools, tool_choice={"type": "function",
                                                       "function": {"name": "x"}}),
                        "tool_choice"),
                       (dict(tools=tools, tool_choice="required",
                             response_format={"type": "json_object"}), "tool_choice")]:
        with pytest.raises(APIError) as err:
            _chat(**bad).structured_output()
        assert err.value.param == param


def test_tool_turns_reach_a_template_without_tools() -> None:
    from everystop.tokenizer import load_tokenizer

    tok = load_tokenizer()  # SmolLM2's template has no tools section
    call = {"id": "c1", "type": "function",
            "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    messages = [{"role": "user", "content": "2 + 3?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    text = tok.render_chat(messages, tools=[{"type": "function", "function": ADD}])
    assert text.startswith("<|im_start|>system\nYou can call these functions:")
    assert json.dumps(ADD) in text
    assert '{"name": "add", "arguments": {"a": 2, "b": 3}}' in text
    assert "<|im_start|>tool\n5<|im_end|>" in text
