"""Connection guards against real sockets on loopback (a toy server subprocess): a slowloris is
cut off at the header deadline, and a client that never reads its stream is evicted (request
aborted, KV blocks freed, connection closed) because its writes block within KBs."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import ServerProcess, start_toy_server

pytestmark = pytest.mark.server


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed `sock` (EOF or reset), reading whatever is buffered."""
    sock.setblocking(False)
    try:
        while True:
            if sock.recv(65536) == b"":
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


@pytest.fixture(scope="module")
def slowloris_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_toy_server(tmp_path_factory.mktemp("conn"), "--header-timeout", "1",
                              "--step-delay", "0.02")
    yield server
    server.stop()


def test_a_slowloris_is_closed_at_the_header_deadline(slowloris_server: ServerProcess) -> None:
    # Timed from before the connection exists (the server's deadline starts after), so a
    # client late after connect() cannot see the close early.
    start = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", slowloris_server.port), timeout=5)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    closed_at = None
    while time.monotonic() - start < 8:  # a header line every 0.1 s, never the blank line
        if _closed_by_server(sock):
            closed_at = time.monotonic() - start
            break
        try:
            sock.sendall(b"X-Slow: 1\r\n")
        except (BrokenPipeError, ConnectionResetError):
            closed_at = time.monotonic() - start
            break
        time.sleep(0.1)
    sock.close()
    assert closed_at is not None, "the trickling connection was never closed"
    # Unguarded, every line would restart uvicorn's keep-alive timer: never closed. The upper
    # bound leaves a loaded host's delays room.
    assert 0.8 < closed_at < 5


def test_complete_requests_and_long_streams_outlive_the_header_deadline(
        slowloris_server: ServerProcess) -> None:
    with httpx.Client(base_url=slowloris_server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        # The same keep-alive connection, well within the 1 s deadline (a request sent just as
        # the server closes the connection would fail: a loaded host may add half a second).
        time.sleep(0.2)
        assert http.get("/health").status_code == 200
        # ~3 s of streaming (150 steps of 20 ms) on a connection with a 1 s header deadline.
        with http.stream("POST", "/v1/completions",
                         json={"model": "toy", "prompt": "a", "max_tokens": 150,
                               "ignore_eos": True, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def _metric(server: ServerProcess, name: str) -> float:
    return server.metric(f"everystop:{name}")


def _never_read_a_stream(tmp: Path, send_buffer: str) -> tuple[bool, bool, str]:
    """Start a stream of ~1.2 MB over at least 5 s (1000 steps of >= 5 ms; 4 choices with
    logprobs) on a socket that never reads. Returns (evicted: the engine requests were aborted
    before they finished, connection closed by the server, server log)."""
    server = start_toy_server(tmp, "--slow-reader-timeout", "1", "--send-buffer-bytes",
                              send_buffer, "--step-delay", "0.005", "--max-model-len", "2048",
                              "--num-gpu-blocks", "4096", "--block-size", "4")
    sock = socket.socket()
    try:
        sock.connect(("127.0.0.1", server.port))
        body = json.dumps({"model": "toy", "prompt": "never read", "max_tokens": 1000, "n": 4,
                           "ignore_eos": True, "stream": True, "logprobs": 5}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 60
        while _metric(server, "num_requests_running") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        while _metric(server, "num_requests_running") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert time.monotonic() < deadline, "the request neither finished nor was aborted"
        assert _metric(server, "kv_cache_usage_perc") == 0.0  # its blocks came back
        # Evicted: they ended before their 1000 tokens (finish_reason "abort", not "length"),
        # as the route counts them (once it has written, or dropped, their last output).
        ends: list[str] = []
        while len(ends) < 4 and time.monotonic() < deadline:
            text = httpx.get(server.url + "/metrics", timeout=5).text
            ends = [reason for ln in text.splitlines()
                    if ln.startswith("everystop:request_success_total{")
                    for reason in re.findall(r'finished_reason="(\w+)"', ln)
                    for _ in range(int(float(ln.rsplit(" ", 1)[1])))]
            time.sleep(0.1)
        assert len(ends) == 4, ends
        time.sleep(0.5)
        closed = _closed_by_server(sock)
        return set(ends) == {"abort"}, closed, server.log()
    finally:
        sock.close()
        server.stop()


def test_a_client_that_never_reads_is_evicted_and_its_blocks_freed(tmp_path: Path) -> None:
    evicted, closed, log = _never_read_a_stream(tmp_path, "16KiB")
    assert evicted, log
    assert closed, "the connection stayed open after its request was evicted"


def test_with_the_kernels_own_buffer_the_same_client_is_never_seen(tmp_path: Path) -> None:
    # The contrast that makes the small buffer necessary: the kernel's own buffer (up to 4 MiB,
    # Linux's default tcp_wmem) takes the whole 1.2 MB stream, every write succeeds, and the
    # requests run to their end.
    evicted, _, log = _never_read_a_stream(tmp_path, "0")
    assert not evicted, log
