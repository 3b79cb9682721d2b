"""Request limits: what one request may cost before any heavy work is done on it.

Checked in this order, each answered with a 4xx that names the limit:

  1. body bytes      (413, `LimitsMiddleware`: Content-Length up front, then counted as the body
                      arrives, so a chunked upload cannot grow past it either)
  2. content type    (415, a declared type that is not JSON; an absent one is taken as JSON)
  3. JSON            (400, `loads`: nesting depth, NaN/Infinity, numbers out of range, lone
                      UTF-16 surrogates; parsed with Python's C decoder, then walked once
                      iteratively, so no input can reach a RecursionError)
  4. token ids       (400, `check_token_ids`: the ids of a token-id prompt or a /detokenize
                      list, counted before they are validated one by one or decoded)
  5. fan-out         (400, `check_fan_out`: prompts per request, and prompts x n)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from everystop.server.errors import APIError, bad_request

# Integers beyond int64 reach nothing we honour (seeds, token ids, counts) and overflow torch.
_INT_LIMIT = 2**63


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 8 << 20
    max_json_depth: int = 32
    max_prompts: int = 128  # prompts in one /v1/completions list
    max_sequences: int = 128  # prompts x n: engine requests one HTTP request may start
    # Token ids in one request's prompt(s) or /detokenize list. Validating and decoding ids
    # hold the GIL in long single calls (1.7M ids: over a second each, a stall of every
    # thread, the event loop's included); this is twice a 128k context.
    max_token_ids: int = 1 << 18

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_prompts", "max_sequences",
                     "max_token_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds max_body_bytes ({limit} bytes)",
                         code="max_body_bytes")


class LimitsMiddleware:
    """Pure ASGI (a streaming response passes through untouched): refuses an oversized body
    before the route reads it, and a non-JSON content type on a request that has a body."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        limit = self.limits.max_body_bytes
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        refusal: APIError | None = None
        if declared > limit:
            refusal = BodyTooLarge(limit)
        elif kind and kind != b"application/json" and not kind.endswith(b"+json"):
            refusal = APIError(415, f"Content-Type must be application/json, got "
                                    f"{kind.decode('latin-1')!r}", code="unsupported_media_type")
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)  # the route's handler answers 413
            return message

        await self.app(scope, counted, send)


def _reject_constant(name: str) -> Any:
    raise bad_request(f"{name} is not a valid JSON number", code="invalid_number")


def _parse_int(text: str) -> int:
    # Python refuses to convert integers of more than 4300 digits with a plain ValueError.
    value = int(text) if len(text) <= 24 else _INT_LIMIT
    if not -_INT_LIMIT <= value < _INT_LIMIT:
        raise bad_request(f"integer {text[:24]}{'...' if len(text) > 24 else ''} is out of "
                          "range (64-bit)", code="invalid_number")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise bad_request(f"number {text[:24]} is out of range", code="invalid_number")
    return value


def loads(raw: bytes | str, max_depth: int) -> Any:
    """JSON text -> Python values, or an APIError(400) saying what is wrong with it."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant, parse_int=_parse_int,
                          parse_float=_parse_float)
    except RecursionError:
        raise bad_request(f"JSON nesting exceeds max_json_depth ({max_depth})",
                          code="max_json_depth") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None
    check_values(data, max_depth)
    return data


def check_values(data: Any, max_depth: int) -> None:
    """Nesting depth and text that cannot be encoded as UTF-8 (lone surrogates such as
    "\\ud800", which JSON's escapes can spell but no tokenizer can read)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            raise bad_request(f"JSON nesting exceeds max_json_depth ({max_depth})",
                              code="max_json_depth")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key)
                stack.append((item, depth + 1))
        else:
            stack.extend((item, depth + 1) for item in value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"text contains an unpaired UTF-16 surrogate at character "
                          f"{exc.start}", code="invalid_unicode") from None


def check_token_ids(data: dict[str, Any], max_token_ids: int) -> None:
    """The ids in `prompt` (a list of ids, or of lists of ids) or `tokens`, at most
    `max_token_ids` in all."""
    for field in ("prompt", "tokens"):
        value = data.get(field)
        if not isinstance(value, list):
            continue
        count = sum(len(v) if isinstance(v, list) else 1 for v in value)
        if count > max_token_ids:
            raise bad_request(f"{field}: {count} token ids exceed max_token_ids "
                              f"({max_token_ids})", field, code="max_token_ids")


def check_fan_out(limits: RequestLimits, num_prompts: int, n: int) -> None:
    if num_prompts > limits.max_prompts:
        raise bad_request(f"{num_prompts} prompts exceed max_prompts ({limits.max_prompts})",
                          "prompt", code="max_prompts")
    if num_prompts * n > limits.max_sequences:
        raise bad_request(f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences exceed "
                          f"max_sequences ({limits.max_sequences})", "n", code="max_sequences")
