"""Server-sent events: `data: {json}\\n\\n` frames ending with `data: [DONE]`, and a response
class that notices a vanished client even while no token is being sent.

Why our own response class: with ASGI spec 2.4 Starlette's StreamingResponse learns of a
disconnect only when a write fails, so a request still queued (nothing to write) would keep its
place and later its KV blocks. Here a listener task waits for `http.disconnect` and cancels the
body; cancelling the body generator aborts the engine request (AsyncEngine.stream's finally).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from json.encoder import encode_basestring
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


# Characters str.splitlines() treats as line breaks that JSON leaves raw: escaped, so clients
# that split SSE lines the Python way do not cut a frame in two.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict[str, Any]) -> bytes:
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


class TextFrames:
    """The SSE frames of mid-stream text chunks (text only: no logprobs, finish reason or
    usage), byte for byte what `sse(build(text))` gives, without building and dumping the
    chunk's dict each token: the frame is built once per second (its `created` field) with a
    marker where the text goes, and the text's JSON string is spliced in."""

    _MARK = "\x00everystop-text\x00"

    def __init__(self, build: Callable[[str], dict[str, Any]]) -> None:
        """`build(text)`: the chunk's body for `text` (its `created` read when called)."""
        self._build = build
        self._second = -1
        self._parts: tuple[bytes, bytes] | None = None

    def frame(self, text: str) -> bytes | None:
        """The frame for `text`, or None where the body cannot be cut at one marker (a model
        name holding the marker): the caller then builds it the long way."""
        second = int(time.time())
        if second != self._second:
            self._second = second
            whole = sse(self._build(self._MARK))
            mark = encode_basestring(self._MARK).encode()
            self._parts = ((whole[:whole.index(mark)], whole[whole.index(mark) + len(mark):])
                           if whole.count(mark) == 1 else None)
        if self._parts is None:
            return None
        head, tail = self._parts
        return head + encode_basestring(text).translate(_LINE_BREAKS).encode() + tail


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], **kw: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, headers=headers, media_type=self.media_type, **kw)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = asyncio.ensure_future(self._send_all(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (body, gone):
                task.cancel()
            for task in (body, gone):
                with contextlib.suppress(asyncio.CancelledError, OSError, Exception):
                    await task
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()  # runs the generator's finally: aborts the engine request

    async def _send_all(self, send: Send) -> None:
        with contextlib.suppress(OSError):  # the client went away mid-write
            await self.stream_response(send)
