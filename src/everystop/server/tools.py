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


def call_schema(function: dict[str, Any], defs: dict[str, Any] | None = None,
                prefix: str = "") -> dict[str, Any]:
    """The JSON schema of one call of `function` (an OpenAI function definition).

    NOTE: `parameters` becomes a subschema, so its "#/..." references would point at the call
    object instead of at it: its `$defs`/`definitions` move into `defs` (the root's, renamed
    with `prefix` so two functions' definitions cannot collide) and every reference is
    rewritten to match; a reference to the parameters' own root ("#", a recursive model)
    points at a copy of it kept in `defs` too."""
    params = function.get("parameters") or {"type": "object", "properties": {}}
    if defs is not None:
        params = _hoist_defs(params, defs, prefix)
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": params},
            "required": ["name", "arguments"]}


def _hoist_defs(params: dict[str, Any], defs: dict[str, Any], prefix: str) -> dict[str, Any]:
    root_name = f"{prefix}root"

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = _moved_ref(value, prefix, root_name)
            elif key in ("$defs", "definitions"):
                continue
            else:
                out[key] = rewrite(value)
        return out

    for section in ("$defs", "definitions"):
        for name, schema in (params.get(section) or {}).items():
            defs[f"{prefix}{name}"] = rewrite(schema)
    moved = rewrite(params)
    if _refers_to_root(params):
        defs[root_name] = moved
    return moved


def _moved_ref(ref: str, prefix: str, root_name: str) -> str:
    for section in ("#/$defs/", "#/definitions/"):
        if ref.startswith(section):
            return f"#/$defs/{prefix}{ref[len(section):]}"
    return f"#/$defs/{root_name}" if ref == "#" else ref


def _refers_to_root(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("$ref") == "#" or any(_refers_to_root(v) for v in node.values())
    if isinstance(node, list):
        return any(_refers_to_root(v) for v in node)
    return False


def tool_constraint(functions: list[dict[str, Any]], choice: str | None,
                    parallel: bool = False) -> StructuredOutput | None:
    """The grammar for `choice` ("required", or the name of one function), else None: one
    call, or with `parallel` also a JSON array of one or more calls."""
    if choice is None:
        return None
    chosen = functions if choice == "required" else [f for f in functions
                                                     if f["name"] == choice]
    defs: dict[str, Any] = {}
    schemas = [call_schema(f, defs, f"f{i}_") for i, f in enumerate(chosen)]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]} if parallel \
        else one
    if defs:
        schema = {**schema, "$defs": defs}
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
