"""A tensor-parallel replica under Ray: `everystop serve --ray-address local
--tensor-parallel-size 2` on loopback (one replica, two CPU ranks of one thread each).

Ray reserves the replica's CPUs for all its ranks at once (deploy.replica_resources), and the
rank-1 worker runs as the replica's child process, inside that reservation.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.cluster.ray_server import ray_server
from tests.server.conftest import ServerProcess

pytestmark = [pytest.mark.model, pytest.mark.server]


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cmd = [sys.executable, "-m", "everystop", "serve", "--ray-address", "local",
           "--tensor-parallel-size", "2", "--threads", "1", "--log-level", "warning",
           "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--max-num-seqs", "4"]
    with ray_server(cmd, tmp_path_factory.mktemp("tp") / "server.log") as server:
        yield server


def test_a_tensor_parallel_replica_serves_with_its_ranks_reserved(
        tp_cluster: ServerProcess) -> None:
    r = httpx.post(tp_cluster.url + "/v1/completions", timeout=60,
                   json={"prompt": "The capital of France is", "max_tokens": 8,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["text"]
    replicas = httpx.get(tp_cluster.url + "/health/replicas", timeout=5).json()["replicas"]
    assert len(replicas) == 1, replicas
    (info,) = replicas.values()
    assert info["status"] == "ok" and info["tensor_parallel_size"] == 2
    # One thread per rank, two ranks: Ray holds two CPUs for this one replica.
    assert info["resources"] == {"CPU": 2.0}, info
    # The rank-1 worker is the replica's own child (it dies with it, and shares its reservation).
    children = psutil.Process(info["pid"]).children()
    assert any("multiprocessing" in " ".join(c.cmdline()) for c in children), \
        [c.cmdline() for c in children]
