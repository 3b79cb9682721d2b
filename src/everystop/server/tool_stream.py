"""Tool calls streamed as they are generated: one choice's text deltas in, OpenAI delta pieces
out (content, or a call's header and then its `arguments` text a few characters at a time).

A reply is one of two things, decided by its first non-blank characters: content (streamed as
it comes), or calls (`{`, `[` or `<tool_call>`; see tools.py for the shapes). A call is
streamed once its `"name"` is a known function and `"arguments"` (or `"parameters"`) follows
it: the header goes out, then the argument value's characters as a JSON scanner reads them, so
the object's own closing brace is never sent as arguments. A reply in call shape that does not
stream that way (keys in another order, an unknown name) is held to the end and parsed whole,
as a non-streamed reply is.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from everystop.server.tools import parse_tool_calls

_TAG = "<tool_call>"
_ARG_KEYS = ("arguments", "parameters")
_STRING_REST = re.compile(r'((?:[^"\\]|\\.)*)"')  # a JSON string's body and closing quote


def _head(text: str, i: int) -> tuple[str, str, int]:
    """Read `{"name": "<name>", "arguments": ` from text[i] (a `{`): ("match", name, end of
    it), ("partial", "", i) when the text ends before it could be decided, or ("no", "", i)."""
    parts: list[str] = []
    i += 1
    for expect in ('"', ":", '"', ",", '"', ":"):
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        if i >= len(text):
            return "partial", "", i
        if text[i] != expect:
            return "no", "", i
        i += 1
        if expect == '"':
            m = _STRING_REST.match(text, i)
            if m is None:
                return "partial", "", i
            parts.append(m.group(1))
            i = m.end()
    key, name, arg_key = parts
    if key != "name" or arg_key not in _ARG_KEYS:
        return "no", "", i
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return "match", json.loads(f'"{name}"'), i


class _ValueScanner:
    """Where one JSON value (object or array) ends, fed a character at a time."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, ch: str) -> bool:
        """True once `ch` closed the value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


class ToolCallStream:
    """One streamed choice's text -> OpenAI delta pieces (see the module doc)."""

    def __init__(self, names: set[str], parallel: bool = True) -> None:
        self.names = names
        self.parallel = parallel
        self.text = ""  # everything fed so far
        self.mode: str | None = None  # None (undecided), "content", "calls", "held"
        self.pos = 0  # how far the call scanner has read self.text
        self.calls: list[dict[str, Any]] = []  # the calls sent (headers)
        self._args: _ValueScanner | None = None  # inside a call's argument value

    def feed(self, delta: str) -> dict[str, Any]:
        """The delta pieces (`content` and/or `tool_calls`) that `delta` makes sendable."""
        self.text += delta
        if self.mode is None:
            self.mode = self._decide()
            if self.mode == "content":
                return {"content": self.text}
        if self.mode == "content":
            return {"content": delta} if delta else {}
        if self.mode == "calls":
            return self._scan()
        return {}

    def finish(self) -> dict[str, Any]:
        """What is left to send when the choice ends."""
        if self.mode == "content" or self.calls:
            return {}
        calls = parse_tool_calls(self.text, self.names)
        if calls is None:
            return {"content": self.text} if self.text else {}
        calls = calls if self.parallel else calls[:1]
        self.calls = calls
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}

    def _decide(self) -> str | None:
        head = self.text.lstrip()
        if not head:
            return None
        if head.startswith(("{", "[", _TAG)):
            return "calls"
        if _TAG.startswith(head):
            return None
        return "content"

    def _scan(self) -> dict[str, Any]:
        pieces: list[dict[str, Any]] = []
        while self.mode == "calls":
            if self._args is not None:
                start = self.pos
                while self.pos < len(self.text):
                    ch = self.text[self.pos]
                    self.pos += 1
                    if self._args.feed(ch):
                        self._args = None
                        break
                if self.pos > start:
                    pieces.append({"index": len(self.calls) - 1,
                                   "function": {"arguments": self.text[start:self.pos]}})
                if self._args is not None:
                    break
                continue
            brace = self.text.find("{", self.pos)
            if brace < 0:
                break
            if self.calls and not self.parallel:
                self.pos = len(self.text)  # one call per turn: later ones are not sent
                break
            state, name, end = _head(self.text, brace)
            if state == "no" or (state == "match" and name not in self.names):
                self.mode = "held"  # not the streamable shape: parsed whole at the end
                break
            if state == "partial" or end >= len(self.text):
                break  # wait for more text (and the value's first character)
            if self.text[end] not in "{[":
                self.mode = "held"  # arguments as a string: parsed whole at the end
                break
            self.pos = end
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": name, "arguments": ""}}
            self.calls.append(call)
            pieces.append({"index": len(self.calls) - 1, **call})
            self._args = _ValueScanner()
        return {"tool_calls": _merge(pieces)} if pieces else {}


def _merge(pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent pieces of one call joined (its header and argument text in one entry)."""
    out: list[dict[str, Any]] = []
    for p in pieces:
        if out and out[-1]["index"] == p["index"]:
            fn = out[-1].setdefault("function", {})
            fn["arguments"] = fn.get("arguments", "") + p["function"]["arguments"]
        else:
            out.append({**p, "function": dict(p["function"])})
    return out
