"""Start real server subprocesses on free loopback ports, bounded in time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lost_its_port(log_text: str) -> bool:
    """Whether a server's log says another process bound its port first: a free port is only
    free until someone binds it, and another test worker (or Ray) may do so in between."""
    return "address already in use" in log_text.lower()


class ServerProcess:
    """A server subprocess on a free loopback port; if the port is taken before the server binds
    it, the server is started again on another one (up to PORT_RETRIES times)."""

    PORT_RETRIES = 3

    def __init__(self, cmd: list[str], port: int, log: Path) -> None:
        self.cmd = cmd
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - the server writes it until stop()
        self._spawn(port)

    def _spawn(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}",
                   OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(self.cmd + ["--host", "127.0.0.1", "--port", str(port)],
                                     cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        retries = self.PORT_RETRIES
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if retries > 0 and lost_its_port(self.log()):
                    retries -= 1
                    self._log.write(f"\n-- port {self.port} was taken; restarting\n".encode())
                    self._spawn(free_port())
                    continue
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        log = self.log()  # before stop() closes it
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s}s:\n{log}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5.0).text
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in " {,":  # a label prefix is ok
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def num_aborted(self) -> float:
        """Requests the server has ended as aborted, over every tenant and tier (0 before the
        first)."""
        text = httpx.get(self.url + "/metrics", timeout=5.0).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("everystop:request_success_total{")
                   and 'finished_reason="abort"' in line)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()
        return self.proc.returncode


def start_toy_server(tmp: Path, *flags: str, ready_s: float = 30.0) -> ServerProcess:
    cmd = [sys.executable, "-m", "tests.server.toy_server", "--log-level", "warning",
           "--max-model-len", "256", *flags]
    server = ServerProcess(cmd, free_port(), tmp / f"server-{time.monotonic_ns()}.log")
    server.wait_ready(ready_s)
    return server


def start_model_server(tmp: Path, *flags: str, ready_s: float = 120.0) -> ServerProcess:
    """The default model behind `everystop serve` with small limits (8 sequences, 256-token
    steps, 512-token context, a 128 MiB pool), so a model test's server starts fast. `flags`
    come after these, so one naming the same option overrides it (argparse keeps the last)."""
    cmd = [sys.executable, "-m", "everystop", "serve", "--log-level", "warning",
           "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--max-model-len", "512",
           "--kv-cache-memory", "128MiB", *flags]
    server = ServerProcess(cmd, free_port(), tmp / "server.log")
    server.wait_ready(ready_s)
    return server


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_toy_server(tmp_path_factory.mktemp("toy"), "--step-delay", "0.003")
    yield server
    server.stop()
