"""Tool calling in chat: the constraint that `tool_choice` "required" or a named function puts
on the output, and the tool calls parsed back out of the generated text into OpenAI's shape.

The tools reach the model through its chat template (`Tokenizer.render_chat(tools=...)`). A
call is the JSON object {"name": ..., "arguments": {...}}, bare or wrapped in the
<tool_call>...</tool_call> tags Hermes-style templates teach ("parameters" is read as
"arguments", as Llama 3.1 writes it). Under "required" or a named choice a JSON-schema grammar
makes the output exactly one such object, valid for that function's parameters (or, with
`parallel_tool_calls` not false, optionally a JSON array of them: several calls in one turn).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from everystop.sampling_params import StructuredOutput

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call of `function` (an OpenAI function definition)."""
    params = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": params},
            "required": ["name", "arguments"]}


def tool_constraint(functions: list[dict[str, Any]], choice: str | None,
                    parallel: bool = False) -> StructuredOutput | None:
    """The grammar for `choice` ("required", or the name of one function), else None: one
    call, or with `parallel` also a JSON array of one or more calls."""
    if choice is None:
        return None
    chosen = functions if choice == "required" else [f for f in functions
                                                     if f["name"] == choice]
    schemas = [call_schema(f) for f in chosen]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]} if parallel \
        else one
    return StructuredOutput("json_schema", json.dumps(schema))


def parse_tool_calls(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """OpenAI `tool_calls` entries for the calls in `text`, or None when it is not a call of
    a known function (then it is the message's content)."""
    bodies = _TAGGED.findall(text) or [text.strip()]
    calls = []
    for body in bodies:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        for call in value if isinstance(value, list) else [value]:
            if not isinstance(call, dict) or call.get("name") not in names:
                return None
            args = call.get("arguments", call.get("parameters", {}))
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"],
                                       "arguments": args if isinstance(args, str)
                                       else json.dumps(args)}})
    return calls or None
