"""Servers a benchmark starts and stops itself: launching everystop on a free loopback port,
llama.cpp's `llama-server` with given flags (its exact command recorded), waiting until /health
answers 200 (or the server failed), stopping them (a signal, then kill), and reading a process's
resident memory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
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


def stop_process(proc: subprocess.Popen, *, sig: int = signal.SIGINT,
                 timeout_s: float = 30.0) -> None:
    """Ask `proc` to stop with `sig`, kill it if it has not within `timeout_s`, and reap it."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


SRC = Path(__file__).resolve().parents[2]  # the src/ these sources run from


def free_port() -> int:
    """A free loopback port (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(*python_path: str | Path, inherit_python_path: bool = False,
              **extra: str) -> dict[str, str]:
    """This process's environment for a child that must import the tree under test: PYTHONPATH
    is `python_path` (then the inherited one, if asked), plus `extra` variables."""
    paths = [str(p) for p in python_path]
    if inherit_python_path and os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}


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
    env = child_env(src, *python_path)
    cmd = [sys.executable, *argv, "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=Path(src).parent, env=env)
    try:
        wait_healthy(proc, url, failure)
        yield proc, url
    finally:
        stop_process(proc)


@dataclass
class LlamaServer:
    """A running llama-server: the exact command that started it, where it answers, its
    process (for its pid, e.g. to read its memory)."""

    command: list[str]
    url: str
    proc: subprocess.Popen


@contextmanager
def llama_server(binary: str, gguf: str, flags: Sequence[str] = (), *, port: int = 0,
                 log_path: str | None = None,
                 timeout_s: float = 300.0) -> Iterator[LlamaServer]:
    """`binary -m gguf --host 127.0.0.1 --port PORT --no-webui *flags` (port 0: a free one),
    healthy when entered (SystemExit naming the command if it exits or stays unhealthy for
    `timeout_s`), terminated on leaving. Its output goes to `log_path`, or nowhere."""
    port = port or free_port()
    command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--no-webui",
               *flags]
    url = f"http://127.0.0.1:{port}"
    with (open(log_path, "w") if log_path else nullcontext(subprocess.DEVNULL)) as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(proc, url, f"llama-server exited or was not healthy in {timeout_s:g} "
                                    f"s: {' '.join(command)}", timeout_s=timeout_s)
            yield LlamaServer(command, url, proc)
        finally:
            stop_process(proc, sig=signal.SIGTERM, timeout_s=60)


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """A process's resident memory now (`rss_bytes`, VmRSS) and at its peak (`peak_rss_bytes`,
    VmHWM), from /proc (Linux)."""
    fields = {"VmRSS": "rss_bytes", "VmHWM": "peak_rss_bytes"}
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            out[fields[key]] = int(value.split()[0]) * 1024
    return out
