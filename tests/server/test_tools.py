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


def test_parallel_constraint_allows_an_array_of_calls() -> None:
    parallel = tool_constraint([ADD, NOW], "required", parallel=True)
    assert parallel is not None
    one, many = json.loads(parallel.spec)["anyOf"]
    assert many == {"type": "array", "items": one, "minItems": 1}
    assert [s["properties"]["name"]["const"] for s in one["anyOf"]] == ["add", "now"]


def test_parallel_tool_calls_field() -> None:
    assert _chat().parallel  # OpenAI's default: several calls allowed
    assert not _chat(parallel_tool_calls=False).parallel
    tools = [{"type": "function", "function": ADD}]
    so = _chat(tools=tools, tool_choice="required", parallel_tool_calls=False).structured_output()
    assert so is not None and "minItems" not in so[1].spec


TWO_CALLS = [
    '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "arguments": {}}]',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
]


def _stream(text: str, parallel: bool = True) -> tuple[str, list[dict[str, str]], int]:
    """Feed `text` a character at a time: (content, calls by index, pieces sent)."""
    from everystop.server.tool_stream import ToolCallStream

    s = ToolCallStream({"add", "now"}, parallel)
    pieces = [s.feed(ch) for ch in text] + [s.finish()]
    content = "".join(p.get("content") or "" for p in pieces)
    calls: dict[int, dict[str, str]] = {}
    for p in pieces:
        for c in p.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] += c.get("id", "")
            call["name"] += c.get("function", {}).get("name", "")
            call["arguments"] += c.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)], sum(1 for p in pieces if p)


@pytest.mark.parametrize("text", TWO_CALLS)
def test_calls_stream_as_they_are_generated(text: str) -> None:
    content, calls, sent = _stream(text)
    assert content == "" and [c["name"] for c in calls] == ["add", "now"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"a": 1, "b": 2}, {}]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    # Token by token, not at the end: every argument character went out on its own.
    assert sent >= len('{"a": 1, "b": 2}') + len("{}")
    (first,) = _stream(text, parallel=False)[1]  # parallel_tool_calls=false: the first only
    assert first["name"] == "add"


@pytest.mark.parametrize(("text", "streamed"), [
    ("The answer is 3.", True), ('{"name": "sub", "arguments": {}}', False),
    ('{"a": 1}', False), ("<tool_call>{oops</tool_call>", False)])
def test_content_streams_and_non_calls_come_back_whole(text: str, streamed: bool) -> None:
    content, calls, sent = _stream(text)
    assert (content, calls) == (text, [])
    assert (sent > 1) == streamed


def test_calls_in_another_key_order_are_sent_whole_at_the_end() -> None:
    content, calls, sent = _stream('{"arguments": {"a": 1, "b": 2}, "name": "add"}')
    assert content == "" and calls[0]["name"] == "add" and sent == 1


def test_chat_chunks_carry_openai_tool_call_deltas() -> None:
    from everystop.server.formatting import ChatFormat

    fmt = ChatFormat("m", None, {"add", "now"})
    text = TWO_CALLS[0]
    tokens = [text[i:i + 3] for i in range(0, len(text), 3)]
    chunks = [fmt.chunk_choice(0, t, None, "stop" if i == len(tokens) - 1 else None, i == 0)
              for i, t in enumerate(tokens)]
    assert chunks[0]["delta"]["role"] == "assistant" and chunks[0]["delta"]["content"] is None
    assert chunks[-1]["finish_reason"] == "tool_calls"
    pieces = [p for c in chunks for p in c["delta"].get("tool_calls", [])]
    heads = [p for p in pieces if "id" in p]
    assert [(p["index"], p["type"], p["function"]["name"]) for p in heads] == \
        [(0, "function", "add"), (1, "function", "now")]
    assert sum(1 for c in chunks if c["delta"].get("tool_calls")) > 5  # not one final lump
    args = ["".join(p["function"].get("arguments", "") for p in pieces if p["index"] == i)
            for i in (0, 1)]
    assert [json.loads(a) for a in args] == [{"a": 1, "b": 2}, {}]
    assert all("content" not in c["delta"] for c in chunks[1:])
    prose = ChatFormat("m", None, {"add"})
    words = ["The", " answer", " is", " 3."]
    deltas = [prose.chunk_choice(0, w, None, "stop" if i == 3 else None, i == 0)["delta"]
              for i, w in enumerate(words)]
    assert [d.get("content") for d in deltas] == words  # content streams as generated
