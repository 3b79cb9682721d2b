"""What clients written for OpenAI and vLLM send back and expect: earlier replies returned as the
SDKs hand them over, usage in every chunk, nested tool schemas, vLLM's small endpoints, and the
400s OpenAI gives for fields that only make sense together."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from everystop.server.protocol import ChatCompletionRequest, parse_body
from everystop.server.tools import tool_constraint

from .conftest import ServerProcess

pytestmark = pytest.mark.server

CHAT = "/v1/chat/completions"


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "toy", "messages": messages, "max_tokens": 4, **extra}


# -- earlier replies sent back --------------------------------------------------------------------

# An assistant turn as the openai SDK's `message.model_dump()` gives it, and as LiteLLM's
# Message carries it: keys that describe the reply, or the client's own bookkeeping.
SDK_TURN = {"role": "assistant", "content": "4", "refusal": None, "audio": None,
            "function_call": None, "tool_calls": None, "annotations": []}
LITELLM_TURN = {"role": "assistant", "content": "4", "tool_calls": None, "function_call": None,
                "provider_specific_fields": {"refusal": None}, "reasoning_content": None}


def _metric(server: ServerProcess, field: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'everystop:ignored_request_fields_total{{field="{field}",'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_earlier_replies_are_accepted_as_clients_send_them(toy_server: ServerProcess) -> None:
    plain = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
             {"role": "user", "content": "and 3+3?"}]
    want = _post(toy_server, CHAT, _chat(plain)).json()["choices"][0]["message"]["content"]
    before = _metric(toy_server, "provider_specific_fields")
    for turn in (SDK_TURN, LITELLM_TURN):
        body = _chat([plain[0], turn, plain[2]])
        r = _post(toy_server, CHAT, body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want  # the same prompt
    assert _metric(toy_server, "provider_specific_fields") == before + 1


def test_content_part_cache_hints_are_dropped(toy_server: ServerProcess) -> None:
    part = {"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}
    r = _post(toy_server, CHAT, _chat([{"role": "user", "content": [part]}]))
    assert r.status_code == 200, r.text


def test_other_unknown_message_keys_are_still_refused(toy_server: ServerProcess) -> None:
    for extra in ({"colour": "red"}, {"function_call": {"name": "f", "arguments": "{}"}}):
        r = _post(toy_server, CHAT, _chat([{"role": "user", "content": "x", **extra}]))
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "unsupported_parameter", r.text


# -- usage and field pairs -------------------------------------------------------------------------

def _frames(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_continuous_usage_stats_put_usage_in_every_chunk(toy_server: ServerProcess) -> None:
    body = _chat([{"role": "user", "content": "count"}], max_tokens=6, stream=True,
                 stream_options={"continuous_usage_stats": True})
    chunks = _frames(toy_server, body)
    with_choices = [c for c in chunks if c["choices"]]
    assert len(with_choices) >= 2 and all("usage" in c for c in with_choices)
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    plain = _frames(toy_server, {**body, "stream_options": {"include_usage": True}})
    assert not any("usage" in c for c in plain if c["choices"])


@pytest.mark.parametrize(("extra", "param"), [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_fields_that_need_another_are_refused_alone(toy_server: ServerProcess,
                                                    extra: dict[str, Any], param: str) -> None:
    r = _post(toy_server, CHAT, _chat([{"role": "user", "content": "x"}], **extra))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- endpoints ------------------------------------------------------------------------------------

def test_version_ping_and_embeddings(toy_server: ServerProcess) -> None:
    from everystop import __version__

    assert httpx.get(toy_server.url + "/version").json() == {"version": __version__}
    assert httpx.get(toy_server.url + "/ping").status_code == 200
    assert httpx.post(toy_server.url + "/ping").status_code == 200
    r = _post(toy_server, "/v1/embeddings", {"model": "toy", "input": "x"})
    assert r.status_code == 404
    assert "embeddings are not served" in r.json()["error"]["message"]


# -- nested tool schemas --------------------------------------------------------------------------

# What pydantic writes for a nested and a recursive model (openai.pydantic_function_tool,
# instructor's TOOLS mode): references into the parameters' own $defs.
NESTED = {"type": "object", "properties": {
    "owner": {"$ref": "#/$defs/Person"},
    "tree": {"$ref": "#/$defs/Node"}},
    "required": ["owner", "tree"],
    "$defs": {
        "Person": {"type": "object", "properties": {"name": {"type": "string"},
                                                    "age": {"type": "integer"}},
                   "required": ["name", "age"]},
        "Node": {"type": "object", "properties": {
            "label": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
            "required": ["label"]}}}
SELF = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                         "v": {"type": "integer"}}, "required": ["v"]}


def _schema(functions: list[dict[str, Any]], choice: str) -> dict[str, Any]:
    constraint = tool_constraint(functions, choice, parallel=False)
    assert constraint is not None and constraint.spec is not None
    return dict(json.loads(constraint.spec))


@pytest.fixture(scope="module")
def compiler() -> Iterator[Any]:
    from everystop.engine.structured_output import StructuredOutputManager
    from everystop.tokenizer import load_tokenizer

    tok = load_tokenizer()
    yield StructuredOutputManager(tok.hf_tokenizer, sorted(tok.eos_token_ids))


def test_nested_defs_resolve_in_tool_grammars(compiler: Any) -> None:
    functions = [{"name": "save", "parameters": NESTED},
                 {"name": "other", "parameters": {**NESTED, "$defs": {
                     "Person": {"type": "string"}, "Node": {"type": "integer"}}}}]
    schema = _schema(functions, "required")
    good = {"name": "save", "arguments": {"owner": {"name": "Ada", "age": 36}, "tree": {
        "label": "a", "children": [{"label": "b", "children": []}]}}}
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):  # a nested type still checked
        jsonschema.validate({**good, "arguments": {**good["arguments"], "owner": {
            "name": "Ada", "age": "old"}}}, schema)
    # The second function's own Person (a string) did not replace the first one's.
    jsonschema.validate({"name": "other", "arguments": {"owner": "Ada", "tree": 3}}, schema)
    from everystop.sampling_params import StructuredOutput

    compiler.compile(StructuredOutput("json_schema", json.dumps(schema)))


def test_a_recursive_root_reference_resolves(compiler: Any) -> None:
    schema = _schema([{"name": "chain", "parameters": SELF}], "chain")
    jsonschema.validate({"name": "chain", "arguments": {"v": 1, "next": {"v": 2}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "chain", "arguments": {"v": 1, "next": {"v": "x"}}},
                            schema)


def test_tool_with_defs_parses_as_a_request() -> None:
    body = _chat([{"role": "user", "content": "x"}], tools=[
        {"type": "function", "function": {"name": "save", "parameters": NESTED}}],
        tool_choice="required")
    req = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    found = req.structured_output()
    assert found is not None and found[0] == "tool_choice"
