"""One live `everystop serve` (the default model, telemetry on, an admin key) under a steady
load from two tenants over three tiers, shared by the operator tests of this package."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.operator.live.load import Load
from tests.server.conftest import ROOT, ServerProcess, free_port

ADMIN_KEY = "operator-test-key"
MODEL_NAME = "smollm2-ops"


@dataclass
class LiveServer:
    server: ServerProcess
    load: Load
    telemetry_db: Path


def ensure_tools(*tools: str) -> list[str]:
    """Paths of Debian tools, installed by scripts/ensure_debian_tools.sh when missing (a
    missing tool fails the test: it must not skip in CI)."""
    proc = subprocess.run([str(ROOT / "scripts" / "ensure_debian_tools.sh"), *tools],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"cannot install {tools}:\n{proc.stderr[-3000:]}"
    sys.stderr.write(proc.stderr)
    return proc.stdout.split()


@pytest.fixture(scope="package")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("operator")
    db = tmp / "telemetry.sqlite"
    # Small limits: 8 sequences, so the burst tenant's queue (cap 2) overflows into 429s.
    cmd = [sys.executable, "-m", "everystop", "serve", "--log-level", "warning",
           "--served-model-name", MODEL_NAME, "--admin-key", ADMIN_KEY,
           "--telemetry-db", str(db), "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
           "--max-model-len", "512", "--kv-cache-memory", "128MiB",
           "--max-queued-per-tenant", "2"]
    server = ServerProcess(cmd, free_port(), tmp / "server.log")
    try:
        server.wait_ready(180)
        load = Load(server.url).start()
        try:
            yield LiveServer(server, load, db)
        finally:
            load.stop()
            # Killed, not drained: a graceful stop would wait out the streams in flight, and
            # nothing here is checked after the tests.
            server.proc.kill()
            server.stop()
            load.join()
    finally:
        server.stop()
