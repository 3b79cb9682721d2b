"""The hostile requests of the robustness suite, each with the answer it must get: the sizes
that froze or crashed a server whose preparation ran on the event loop, or whose intake
trusted token ids.
Shared by the hostile test suite (tests/robustness/test_hostile.py) and its benchmark
(`everystop bench hostile`), which measures /health's latency while each one is served.

A server that serves them needs `--max-body-bytes 32MiB` (the 15 MB /tokenize body)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

NON_ASCII_WORDS = "naïve café über ß "  # 22 bytes of UTF-8 in 18 characters
FULL_TOKENIZE_CHARS = 12_300_000  # 15 MB of UTF-8
SLOWLORIS_CONNECTIONS = 200


@dataclass(frozen=True)
class HostileCase:
    """One request: where it goes, its body (built when it runs: some are megabytes), the
    status it must get and, for a refusal, the limit or field its error must name."""

    name: str
    path: str
    body: Callable[[], dict[str, object]]
    status: int
    names: str | None = None

    def raw_body(self) -> bytes:
        """The body as JSON in UTF-8 (non-ASCII text as itself, not as \\u escapes)."""
        return json.dumps(self.body(), separators=(",", ":"), ensure_ascii=False).encode()


def _words(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


def _chat(**fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def _deep_arrays(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + "{}" + "}" * depth


def _enum_schema() -> dict[str, object]:
    """100k strings of 17 characters: a 2.0 MB body."""
    return _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "e", "schema": {"enum": [f"enum-value-{i:06d}" for i in range(100_000)]}}})


def _big_tool() -> dict[str, object]:
    properties = {p: {"type": "string"} for p in _words(80_000)}
    return _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": properties}}}])


def hostile_cases(tokenize_chars: int = FULL_TOKENIZE_CHARS) -> list[HostileCase]:
    """Every single-request case, at the issue's sizes but for the non-ASCII /tokenize, whose
    length in characters is `tokenize_chars`. Token-id lists over the server's max_token_ids
    are refused before they are validated; the 250k-id lists go the whole way through a
    worker."""
    text = NON_ASCII_WORDS * (tokenize_chars // len(NON_ASCII_WORDS))
    return [
        HostileCase("logit_bias_overflow", "/v1/completions",
                    lambda: {"prompt": "x", "max_tokens": 4,
                             "logit_bias": {"100000000000000000000": 5}}, 400, "logit_bias"),
        HostileCase("enum_100k", "/v1/chat/completions", _enum_schema, 400, "max_spec_bytes"),
        HostileCase("arrays_5k_deep", "/v1/completions",
                    lambda: {"prompt": "x", "max_tokens": 4, "guided_json": _deep_arrays(5000)},
                    400, "max_schema_depth"),
        HostileCase("regex_200k_words", "/v1/completions",
                    lambda: {"prompt": "x", "max_tokens": 4,
                             "guided_regex": "|".join(_words(200_000))}, 400, "max_regex_chars"),
        HostileCase("choice_20k", "/v1/completions",
                    lambda: {"prompt": "x", "max_tokens": 4, "guided_choice": _words(20_000)},
                    400, "max_choices"),
        HostileCase("tool_80k_properties", "/v1/chat/completions", _big_tool, 400,
                    "max_schema_properties"),
        HostileCase("detokenize_10MB", "/detokenize", lambda: {"tokens": [12345] * 1_700_000},
                    400, "max_token_ids"),
        HostileCase("detokenize_250k", "/detokenize", lambda: {"tokens": [12345] * 250_000},
                    200),
        HostileCase("prompt_1.7M_ids", "/v1/completions",
                    lambda: {"prompt": [42] * 1_700_000, "max_tokens": 4}, 400, "max_token_ids"),
        HostileCase("prompt_250k_ids", "/v1/completions",
                    lambda: {"prompt": [42] * 250_000, "max_tokens": 4}, 400, "max_model_len"),
        HostileCase("tokenize_non_ascii", "/tokenize", lambda: {"prompt": text}, 200),
    ]


def names_its_limit(error: dict[str, object], names: str) -> bool:
    """Whether a refusal's OpenAI-style error names `names` in its message and as its code or
    param (a context overflow has OpenAI's code, context_length_exceeded)."""
    code = "context_length_exceeded" if names == "max_model_len" else names
    return names in str(error.get("message")) and code in (error.get("code"), error.get("param"))


def open_slowloris(port: int, n: int = SLOWLORIS_CONNECTIONS) -> list[socket.socket]:
    """`n` loopback connections, each sending a request line and one header, never the blank
    line that ends the headers."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        socks.append(sock)
    return socks


def closed_by_server(socks: list[socket.socket], within_s: float) -> int:
    """How many of `socks` the server closed (EOF or reset) within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    pending = list(socks)
    while pending and time.monotonic() < deadline:
        still = []
        for sock in pending:
            sock.settimeout(0.01)
            try:
                if sock.recv(1 << 12) == b"":
                    continue
            except TimeoutError:
                pass
            except ConnectionError:
                continue
            still.append(sock)
        pending = still
    return len(socks) - len(pending)
