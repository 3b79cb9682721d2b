"""The connection guards on both of uvicorn's HTTP parsers (httptools, h11), in-process with a
bare ASGI app and real loopback sockets: the header deadline, pipelined requests, and a write
stall told apart from a slow reader."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from everystop.server.connections import ConnectionLimits, guarded_protocol

from .conftest import free_port

BIG = 2 << 20  # bytes in /big's body
LIMITS = ConnectionLimits(header_timeout_s=0.5, send_buffer_bytes=16 << 10,
                          write_stall_timeout_s=1.0)
# uvicorn's own keep-alive timeout (5 s, restarted by every byte received): the guard's
# deadlines must close connections well before it, with room for a loaded host's delays.
WELL_BEFORE_UVICORN_S = 3.0


class App:
    """/big: 2 MiB in 16 KiB chunks, recording whether the client was gone at the end."""

    def __init__(self) -> None:
        self.big_outcomes: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        size = BIG if scope["path"] == "/big" else 2
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(size).encode())]})
        if size == 2:
            await send({"type": "http.response.body", "body": b"ok"})
            return
        chunk = b"x" * (16 << 10)
        for _ in range(size // len(chunk)):  # ASGI 2.4: sends after a disconnect are dropped
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        try:
            message = await asyncio.wait_for(receive(), 0.1)
        except TimeoutError:
            message = {"type": "nothing"}
        self.big_outcomes.append("gone" if message["type"] == "http.disconnect" else "sent")


@pytest.fixture(params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[int, App]]:
    app, port = App(), free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            http=guarded_protocol(LIMITS, request.param), lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port, app
    server.should_exit = True
    thread.join(timeout=10)


def _wait_closed(sock: socket.socket, timeout_s: float,
                 since: float | None = None) -> float | None:
    """Seconds until the server closed `sock` (reading and dropping what arrives), counted
    from `since` (a time.monotonic(); None: now), or None after `timeout_s` of waiting."""
    start = time.monotonic() if since is None else since
    sock.settimeout(0.05)
    while time.monotonic() - start < timeout_s:
        try:
            if sock.recv(1 << 16) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - start
    return None


def test_headers_never_finished_are_cut_off_and_idle_keep_alive_too(
        served: tuple[int, App]) -> None:
    port, _ = served
    # Timed from before the connection exists: the server's deadline starts after that, so
    # however late this thread gets on, the close cannot look early.
    connecting = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        closed = _wait_closed(sock, 5, since=connecting)
    assert closed is not None and 0.4 < closed < WELL_BEFORE_UVICORN_S
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        assert sock.recv(1 << 16).endswith(b"ok")
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the next request stalls
        closed = _wait_closed(sock, 5)
    assert closed is not None and closed < WELL_BEFORE_UVICORN_S


def test_pipelined_requests_are_all_answered(served: tuple[int, App]) -> None:
    port, _ = served
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        got = b""
        sock.settimeout(2)
        while got.count(b"ok") < 3:
            data = sock.recv(1 << 16)
            assert data, f"closed after {got.count(b'ok')} answers"
            got += data
        time.sleep(0.8)  # past the deadline, idle: closed now, or soon on a loaded host
        assert _wait_closed(sock, WELL_BEFORE_UVICORN_S - 0.8) is not None


def _fetch_big(port: int, read_every_s: float | None) -> tuple[int, bool]:
    """GET /big, reading 64 KiB every `read_every_s` (None: never). (bytes read, closed early)"""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    got, closed = 0, False
    try:
        if read_every_s is None:
            time.sleep(2.0)
            closed = _wait_closed(sock, 2) is not None
            return got, closed
        sock.settimeout(2)
        while got < BIG:
            time.sleep(read_every_s)
            data = sock.recv(64 << 10)
            if not data:
                return got, True
            got += len(data)
        return got, closed
    except ConnectionResetError:
        return got, True
    finally:
        sock.close()


def test_a_client_that_takes_nothing_is_dropped_and_a_slow_one_is_not(
        served: tuple[int, App]) -> None:
    port, app = served
    _, closed = _fetch_big(port, None)
    assert closed
    deadline = time.monotonic() + 5
    while not app.big_outcomes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.big_outcomes == ["gone"]
    # 64 KiB every 50 ms: far slower than the server writes, never still for 1 s.
    got, closed = _fetch_big(port, 0.05)
    assert not closed and got >= BIG
