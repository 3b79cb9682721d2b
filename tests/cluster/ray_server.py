"""An `everystop serve` on Ray for the cluster tests: started on a free port, and stopped with
every process Ray spawned under it (replicas, tensor-parallel ranks)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from tests.server.conftest import ServerProcess, free_port


@contextmanager
def ray_server(cmd: list[str], log_path: Path,
               ready: Callable[[ServerProcess], None] | None = None) -> Iterator[ServerProcess]:
    server = ServerProcess(cmd, free_port(), log_path)
    try:
        server.wait_ready(150)
        if ready is not None:
            ready(server)
        yield server
    finally:
        # Ray's processes are the server's descendants; whatever survives its shutdown goes.
        try:
            family = psutil.Process(server.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        server.stop()
        _, alive = psutil.wait_procs(family, timeout=10)
        for proc in alive:
            proc.kill()
