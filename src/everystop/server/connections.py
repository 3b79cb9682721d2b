"""Per-connection guards uvicorn does not have, on its own HTTP protocol class:

- a header deadline: a connection that has not sent a request's complete headers within
  `header_timeout_s` of opening, or of its previous response, is closed. uvicorn's keep-alive
  timeout restarts on every byte received, so a client trickling a byte at a time (slowloris)
  would hold its connection for ever.
- a small kernel send buffer (SO_SNDBUF on every accepted socket). Linux grows it to 4 MiB per
  connection by itself, so a client that stops reading keeps accepting megabytes of tokens and
  the server never learns it stopped; a small one stops the writes within a few hundred KB
  (this buffer, the client's receive window and asyncio's 64 KiB high-water mark), the stream
  goes unread, and the engine's slow-reader eviction aborts the request.
- a write-stall deadline: a connection whose writes are paused (its buffers full) and whose
  client takes none of the waiting bytes for `write_stall_timeout_s` is aborted, so a client
  that never reads again does not keep its connection and its buffered bytes after its request
  was evicted. A client that reads, however slowly, keeps it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger("everystop.server")


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float | None = 10.0  # None: no deadline
    send_buffer_bytes: int = 128 << 10  # 0: the kernel's default (autotuned)
    write_stall_timeout_s: float | None = 60.0  # None: never

    def __post_init__(self) -> None:
        if self.header_timeout_s is not None and self.header_timeout_s <= 0:
            raise ValueError("header_timeout_s must be > 0 (or None: no deadline)")
        if self.send_buffer_bytes < 0:
            raise ValueError("send_buffer_bytes must be >= 0 (0: the kernel's default)")


class _Guards(asyncio.Protocol):
    """Mixed in before uvicorn's protocol class (`guarded_protocol`): its hooks call uvicorn's."""

    limits: ConnectionLimits
    # uvicorn's protocol state, read here: the request/response cycle in progress, if any.
    cycle: Any
    transport: Any
    _header_timer: asyncio.TimerHandle | None = None
    _stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if self.limits.send_buffer_bytes and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
        self._await_headers(None)

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._await_headers(finished)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._watch_stall()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _await_headers(self, last: Any) -> None:
        """Close the connection unless a request after `last` (None: the first) has its
        headers in by the deadline."""
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        timeout = self.limits.header_timeout_s
        if timeout is not None:
            self._header_timer = asyncio.get_running_loop().call_later(
                timeout, self._headers_late, last)

    def _headers_late(self, last: Any) -> None:
        self._header_timer = None
        # NOTE: a pipelined request may already be `cycle` while `last` was being answered:
        # the connection is idle only when no cycle began, or the newest one is done.
        idle = self.cycle is last and (last is None or last.response_complete)
        if idle and not self.transport.is_closing():
            self.transport.close()

    def _watch_stall(self, waiting: int | None = None) -> None:
        """Abort unless the client takes some of the bytes waiting now within the timeout."""
        timeout = self.limits.write_stall_timeout_s
        if timeout is not None:
            waiting = self.transport.get_write_buffer_size() if waiting is None else waiting
            self._stall_timer = asyncio.get_running_loop().call_later(
                timeout, self._check_stall, waiting)

    def _check_stall(self, waiting: int) -> None:
        self._stall_timer = None
        now = self.transport.get_write_buffer_size()
        if now < waiting:  # still paused, but the client took some: it is reading
            self._watch_stall(now)
            return
        logger.warning("closing a connection whose client took nothing for %.0fs",
                       self.limits.write_stall_timeout_s)
        self.transport.abort()  # close() would wait for the unsent bytes


def guarded_protocol(limits: ConnectionLimits,
                     base: type[asyncio.Protocol] = AutoHTTPProtocol) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (by default httptools when installed, else h11) with the
    guards: pass it as uvicorn.Config(http=...)."""
    return type("GuardedHTTPProtocol", (_Guards, base), {"limits": limits})
