"""Two Ray nodes on one machine, one engine replica on each, one ingress in front: the
several-machines path of docs/scale-out.md, run for real on loopback and measured.

    ray start --head --num-cpus 1 --resources '{"node_a": 1}'      (node 1)
    ray start --address HEAD --num-cpus 1 --resources '{"node_b": 1}'  (node 2)
    everystop serve --replicas 2 --ray-address HEAD --replica-num-cpus 1

Each node offers one CPU and each replica asks for one, so Ray must place one replica per node.
The script checks that it did (each replica's node id, from /health/replicas), that requests
reach both, then stops everything it started: the ingress, then each Ray node's processes,
found by this run's own temp dir (never `ray stop`, which would end every Ray on the machine),
and checks `ps` that none is left.

    PYTHONPATH=src python scripts/ray_two_nodes.py --out benchmarks/results/ray_two_nodes.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

from everystop.bench.servers import free_port, stop_process
from everystop.results import write_result

RAY = str(Path(sys.executable).with_name("ray"))


def _ray(*args: str, env: dict[str, str]) -> None:
    subprocess.run([RAY, *args], check=True, env=env, stdout=subprocess.DEVNULL, timeout=180)


def _ours(temp_dir: str) -> list[psutil.Process]:
    """The Ray nodes we started: processes whose command line names this run's temp dir, and
    their descendants (workers retitle themselves `ray::...`, hiding their arguments)."""
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg for arg in p.info["cmdline"] or ()):
                found[p.pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.Error:
            continue
    return list(found.values())


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _nodes(head: str) -> list[dict[str, Any]]:
    """The cluster's nodes as Ray lists them (this process joins as a driver, then leaves)."""
    import ray

    ray.init(address=head, logging_level="ERROR")
    try:
        return [{"id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"]}
                for n in ray.nodes()]
    finally:
        ray.shutdown()


def _complete(url: str, i: int) -> dict[str, Any]:
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": f"Tell me about the number {i}.", "max_tokens": 16, "ignore_eos": True,
        "temperature": 0, "user": f"u{i}"})
    r.raise_for_status()
    return {"e2e_s": time.monotonic() - t0, "tokens": r.json()["usage"]["completion_tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--requests", type=int, default=16)
    args = ap.parse_args()
    # Short: Ray puts unix sockets under it (about 100 characters at most).
    temp_dir = tempfile.mkdtemp(prefix="esray", dir="/tmp")
    gcs_port, http_port = free_port(), free_port()
    head = f"127.0.0.1:{gcs_port}"
    # One auth mode for every Ray process of the run. Left unset, Ray 2.60's `ray start --head`
    # turns token auth on when ~/.ray/auth_token exists, but `ray start --address` does not,
    # and the second node is refused (InvalidAuthToken). Loopback test cluster: no tokens.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    result: dict[str, Any] = {"benchmark": "ray_two_nodes", "load_avg_start": list(os.getloadavg())}
    ingress = None
    log = open(Path(temp_dir) / "ingress.log", "wb")  # noqa: SIM115 - closed in finally
    t0 = time.monotonic()
    try:
        # Ray binds its own services to this host's address (it resolves 127.0.0.1 to it);
        # the ingress's HTTP port is on loopback.
        # Both nodes under this run's own temp dir: `_ours` finds their processes by it, and no
        # other Ray on the machine (default /tmp/ray) is touched.
        _ray("start", "--head", f"--port={gcs_port}", "--num-cpus=1", '--resources={"node_a": 1}',
             f"--temp-dir={temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
             env=env)
        _ray("start", f"--address={head}", "--num-cpus=1", '--resources={"node_b": 1}',
             f"--temp-dir={temp_dir}", "--disable-usage-stats", env=env)
        result["ray_nodes_up_s"] = time.monotonic() - t0
        ingress = subprocess.Popen(
            [sys.executable, "-m", "everystop", "serve", "--replicas", "2", "--threads", "1",
             "--ray-address", head, "--replica-num-cpus", "1", "--max-model-len", "512",
             "--kv-cache-memory", "64MiB", "--log-level", "warning", "--port", str(http_port)],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{http_port}"
        replicas: dict[str, Any] = {}
        while len(replicas) < 2 or not all(r["status"] == "ok" for r in replicas.values()):
            if ingress.poll() is not None or time.monotonic() - t0 > 300:
                raise SystemExit(f"the ingress did not come up; see {log.name}")
            with contextlib.suppress(httpx.HTTPError, json.JSONDecodeError, KeyError):
                replicas = httpx.get(url + "/health/replicas", timeout=2).json()["replicas"]
            time.sleep(0.5)
        result["serving_s"] = time.monotonic() - t0
        nodes = _nodes(head)
        result["ray_nodes"] = nodes
        result["replicas"] = replicas
        t1 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            done = list(pool.map(lambda i: _complete(url, i), range(args.requests)))
        result["requests"] = {"n": len(done), "wall_s": time.monotonic() - t1,
                              "output_tokens": sum(d["tokens"] for d in done),
                              "e2e_s_max": max(d["e2e_s"] for d in done)}
        routed = {}
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("everystop_router_requests_total{"):
                name, value = line.rsplit(" ", 1)
                routed[name.split('replica="')[1].split('"')[0]] = float(value)
        result["routed"] = routed
        placed_on = {r["node"] for r in replicas.values()}
        alive = {n["id"] for n in nodes if n["alive"]}
        result["checks"] = {
            "two_alive_nodes": len(alive) == 2,
            "one_replica_per_node": len(placed_on) == 2 and placed_on <= alive,
            "both_replicas_served": len(routed) == 2 and min(routed.values()) >= 1,
            "all_requests_completed": all(d["tokens"] == 16 for d in done)}
    finally:
        if ingress is not None:
            stop_process(ingress, timeout_s=60)
        log.close()
        procs = _ours(temp_dir)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive_procs = psutil.wait_procs(procs, timeout=15)
        for p in alive_procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive_procs, timeout=5)
        left = [p.pid for p in _ours(temp_dir) + procs if _alive(p)]
        result["ray_processes_stopped"] = len(procs)
        result["ray_processes_left"] = left
        shutil.copy(Path(temp_dir) / "ingress.log", "/tmp/ray_two_nodes_ingress.log")
        shutil.rmtree(temp_dir, ignore_errors=True)
    result["load_avg_end"] = list(os.getloadavg())
    write_result(result, args.out)
    ok = all(result.get("checks", {"ran": False}).values()) and not result["ray_processes_left"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
