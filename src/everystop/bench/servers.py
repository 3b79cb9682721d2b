"""Servers a benchmark starts: launching one on a free loopback port, waiting until its /health
answers 200 (or it failed), stopping it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx


def wait_healthy(proc: subprocess.Popen, url: str, failure: str, timeout_s: float = 300.0,
                 poll_s: float = 0.2) -> None:
    """Return once `url`/health answers 200; SystemExit(`failure`) if `proc` exits first or
    `timeout_s` passes (the benchmark has nothing to measure then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(failure)
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)


SRC = Path(__file__).resolve().parents[2]  # the src/ these sources run from


def free_port() -> int:
    """A free loopback port (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def everystop_server(flags: Sequence[str], *, src: str | Path = SRC,
                     argv: Sequence[str] = ("-m", "everystop", "serve"),
                     python_path: Sequence[str | Path] = (), failure: str = "server did not come up"
                     ) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python -m everystop serve FLAGS` from the sources in `src` (another checkout's, to
    compare), on a free loopback port; yields (process, base URL) once /health answers 200,
    and stops it (SIGINT, then kill) on the way out. `argv` replaces the entry point (a test
    server module), `python_path` adds directories after `src`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (src, *python_path)))
    cmd = [sys.executable, *argv, "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=Path(src).parent, env=env)
    try:
        wait_healthy(proc, url, failure)
        yield proc, url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
