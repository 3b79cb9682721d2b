"""`everystop serve --replicas 2` on loopback: a local Ray instance, two replicas of the default
model (one thread each), the router, cluster-wide admission, and a replica killed under load.

One server for the module (Ray and two model loads cost most of the time); the tests run in
file order and the replica kill comes last.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.cluster.ray_server import ray_server
from tests.server.conftest import ServerProcess

pytestmark = [pytest.mark.model, pytest.mark.server]
KEY = "cluster-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"X-Admin-Key": "cluster-admin-key"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cmd = [sys.executable, "-m", "everystop", "serve", "--replicas", "2", "--threads", "1",
           "--log-level", "warning", "--api-key", KEY, "--admin-key", ADMIN["X-Admin-Key"],
           "--max-num-seqs", "2",
           "--max-queued-per-tenant", "1", "--max-num-batched-tokens", "256",
           "--max-model-len", "512", "--kv-cache-memory", "64MiB"]
    with ray_server(cmd, tmp_path_factory.mktemp("cluster") / "server.log",
                    lambda s: _wait_for(lambda: len(_replicas(s)) == 2, 20,
                                        "two replicas reporting")) as server:
        yield server


def _wait_for(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _replicas(server: ServerProcess) -> dict[str, dict[str, Any]]:
    r = httpx.get(server.url + "/health/replicas", timeout=5)
    return dict(r.json()["replicas"])


def _metrics(server: ServerProcess) -> dict[str, float]:
    out = {}
    # /metrics needs the API key when one is set (#17).
    r = httpx.get(server.url + "/metrics", headers=AUTH, timeout=5)
    r.raise_for_status()
    for line in r.text.splitlines():
        if line.startswith("everystop_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            # Every series carries the served model's name (#21); the keys below leave it out.
            name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")
            out[name] = float(value)
    return out


def _send_burst(server: ServerProcess, count: int, user_prefix: str) -> None:
    """`count` short completions at once, each from its own user (no affinity among them)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

    def one(i: int) -> None:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Count to {i}:",
                                  max_tokens=4, temperature=0, user=f"{user_prefix}-{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def _sum(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def test_the_openai_client_talks_to_the_cluster_unchanged(cluster: ServerProcess) -> None:
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0)
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt="The sky is",
                                            max_tokens=6, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks).strip()
    # The same auth and error bodies as one engine.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster.url + "/v1", api_key="wrong", max_retries=0) \
            .completions.create(model="SmolLM2-135M-Instruct", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", max_tokens=1,
                                  temperature=-1)


def test_a_burst_is_spread_over_both_replicas(cluster: ServerProcess) -> None:
    before = _metrics(cluster)
    _send_burst(cluster, 6, "burst")
    after = _metrics(cluster)
    sent = {k: after[k] - before.get(k, 0.0) for k in after
            if k.startswith("everystop_router_requests_total")}
    assert len(sent) == 2 and sum(sent.values()) == 6
    assert min(sent.values()) >= 2, sent  # least-loaded with in-flight correction spreads it
    why = {k: after[k] - before.get(k, 0.0) for k in after
           if k.startswith("everystop_router_decisions_total")}
    assert sum(why.values()) == 6, why  # each request's reason counted once
    assert all('reason="least_loaded"' in k for k, n in why.items() if n), why
    assert any(k.startswith("everystop_replica_kv_cache_total_blocks{") and 'replica="' in k
               for k in after)


def _waiting_is(server: ServerProcess, n: int) -> Any:
    return lambda: _sum(_metrics(server), "everystop_replica_num_requests_waiting") == n


def _hog(server: ServerProcess, i: int, stop: threading.Event, started: list[str]) -> None:
    """A long stream, held open until `stop`, then dropped (a disconnect)."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 400,
            "ignore_eos": True, "stream": True, "user": f"hog-{i}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                started.append(line)
            if stop.is_set():
                return


def test_queue_full_tries_the_next_replica_and_all_full_answers_429(
        cluster: ServerProcess) -> None:
    before = _metrics(cluster)
    stop, started = threading.Event(), []  # type: ignore[var-annotated]
    hogs = [threading.Thread(target=_hog, args=(cluster, i, stop, started)) for i in range(4)]
    for t in hogs:
        t.start()
        time.sleep(0.3)
    try:
        # Both replicas run two hogs each (max-num-seqs 2): the next requests of tenant "late"
        # queue, one per replica (max-queued-per-tenant 1), and the one after finds every
        # replica full.
        _wait_for(lambda: _sum(_metrics(cluster), "everystop_replica_num_requests_running") == 4,
                  30, "four hogs running")
        queued = []
        for _ in range(2):
            queued.append(threading.Thread(target=httpx.post, args=(
                cluster.url + "/v1/completions",), kwargs={
                "json": {"prompt": "Hi", "max_tokens": 2, "user": "late"}, "headers": AUTH,
                "timeout": 120}))
            queued[-1].start()
            _wait_for(_waiting_is(cluster, len(queued)), 10, f"{len(queued)} queued")
        r = httpx.post(cluster.url + "/v1/completions", headers=AUTH, timeout=30,
                       json={"prompt": "Hi", "max_tokens": 2, "user": "late"})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        after = _metrics(cluster)
        # The 429 came only after the second replica refused too.
        assert after['everystop_router_retries_total{reason="queue_full"}'] - before.get(
            'everystop_router_retries_total{reason="queue_full"}', 0.0) >= 1
        assert after['everystop_cluster_requests_total{outcome="refused"}'] - before[
            'everystop_cluster_requests_total{outcome="refused"}'] == 1
    finally:
        stop.set()
        for t in hogs:
            t.join(60)
    # Dropped streams are aborted on their replicas: the slots free up, the queued two run.
    _wait_for(lambda: _sum(_metrics(cluster), "everystop_replica_num_requests_running") == 0
              and _sum(_metrics(cluster), "everystop_replica_num_requests_waiting") == 0,
              30, "the hogs aborted and the queue drained")
    for t in queued:
        t.join(60)
    after = _metrics(cluster)
    assert after['everystop_cluster_requests_total{outcome="aborted"}'] - before[
        'everystop_cluster_requests_total{outcome="aborted"}'] == 4


def test_admin_fans_out_to_every_replica_or_refuses_by_name(cluster: ServerProcess) -> None:
    url = cluster.url + "/admin/scheduler_config"
    assert httpx.get(url, timeout=10).status_code == 401
    got = httpx.get(url, headers=ADMIN, timeout=10).json()
    assert got["consistent"] and got["config"]["max_queued_per_tenant"] == 1
    assert sorted(got["replicas"]) == sorted(_replicas(cluster))
    # A change reaches every replica. (Later tests use a tenant per request: 3 changes nothing
    # for them; the restart test below reads it back.)
    r = httpx.patch(url, headers=ADMIN, json={"max_queued_per_tenant": 3}, timeout=30)
    assert r.status_code == 200, r.text
    assert all(s["config"]["max_queued_per_tenant"] == 3 and s["version"] == 2
               for s in r.json()["replicas"].values()) and len(r.json()["replicas"]) == 2
    assert httpx.get(url, headers=ADMIN, timeout=10).json()["config"]["max_queued_per_tenant"] == 3
    # A bad value is refused by the first replica, by name, and changes nothing anywhere.
    r = httpx.patch(url, headers=ADMIN, json={"max_num_seqs": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_num_seqs", r.text
    r = httpx.patch(url, headers=ADMIN, json={"max_model_len": 64}, timeout=30)
    assert r.json()["error"]["code"] == "unsupported_parameter"
    got = httpx.get(url, headers=ADMIN, timeout=10).json()
    assert got["consistent"] and got["config"]["max_num_seqs"] == 2
    assert {s["version"] for s in got["replicas"].values()} == {2}
    # The history needs the telemetry store, which the ingress does not run: refused by name.
    r = httpx.get(url + "/history", headers=ADMIN, timeout=10)
    assert r.status_code == 501 and r.json()["error"]["code"] == "unsupported_in_cluster_mode"


def _stream_outcome(server: ServerProcess, i: int, results: dict[int, str]) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": f"Story number {i}:", "max_tokens": 24,
            "ignore_eos": True, "stream": True, "user": f"load-{i}"}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=90) as r:
            if r.status_code != 200:
                results[i] = f"http {r.status_code}"
                return
            finish, error = None, None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                    elif event["choices"] and event["choices"][0]["finish_reason"]:
                        finish = event["choices"][0]["finish_reason"]
            results[i] = "completed" if finish == "length" and error is None else \
                f"error: {error}"
    except httpx.HTTPError as exc:
        results[i] = f"transport: {exc!r}"


def test_a_replica_killed_under_load_loses_nothing_silently(cluster: ServerProcess) -> None:
    before = _metrics(cluster)
    pids = {rid: info["pid"] for rid, info in _replicas(cluster).items()}
    results: dict[int, str] = {}
    n = 10
    threads = [threading.Thread(target=_stream_outcome, args=(cluster, i, results))
               for i in range(n)]
    for t in threads:
        t.start()
    # Kill one replica once both are busy (two streaming, the rest queued behind them).
    _wait_for(lambda: _sum(_metrics(cluster), "everystop_replica_num_requests_waiting") >= 4,
              30, "a queue on the replicas")
    victim = max(pids, key=lambda rid: _metrics(cluster).get(
        f'everystop_replica_num_requests_waiting{{replica="{rid}"}}', 0.0))
    os.kill(pids[victim], signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(results) == n
    completed = [i for i, r in results.items() if r == "completed"]
    errored = {i: r for i, r in results.items() if r != "completed"}
    # Streams under way on the victim end with an error event naming the replica.
    assert all("error:" in r and victim in r for r in errored.values()), errored
    after = _metrics(cluster)

    def delta(outcome: str) -> float:
        key = f'everystop_cluster_requests_total{{outcome="{outcome}"}}'
        return after[key] - before[key]

    # Queued requests on the victim (no output yet) were re-routed and completed elsewhere.
    assert delta("retried_completed") >= 1
    assert delta("completed") + delta("retried_completed") == len(completed)
    assert delta("errored") == len(errored)
    assert delta("aborted") == delta("refused") == 0
    # The cluster still answers (the survivor), and Ray replaces the dead replica.
    assert httpx.get(cluster.url + "/health", timeout=5).status_code == 200
    _wait_for(lambda: victim not in _replicas(cluster), 30, "the dead replica to be removed")


def test_ray_restarts_the_killed_replica_and_the_router_uses_it(cluster: ServerProcess) -> None:
    """After the kill above: Ray starts a replacement (a new replica id, a new process), /health
    lists it once it reports, and the router sends it work again."""
    replicas: dict[str, dict[str, Any]] = {}

    def two_healthy() -> bool:
        replicas.clear()
        replicas.update(_replicas(cluster))
        return len(replicas) == 2 and all(r["status"] == "ok" for r in replicas.values())

    # Ray's health check runs every second; the new replica loads the model on one thread
    # (over 60 s on a 2-core host beside another test worker).
    _wait_for(two_healthy, 120, "Ray to restart the killed replica")
    before = _metrics(cluster)
    assert all(r["pid"] and r["node"] for r in replicas.values()), replicas
    assert len({r["pid"] for r in replicas.values()}) == 2
    assert all(r["resources"] == {"CPU": 1.0} for r in replicas.values()), replicas
    # The replacement runs the start-up config, the survivor the one PATCHed above: /admin
    # says they differ instead of showing either as the cluster's.
    got = httpx.get(cluster.url + "/admin/scheduler_config", headers=ADMIN, timeout=10).json()
    assert not got["consistent"] and got["config"] is None
    assert sorted(s["config"]["max_queued_per_tenant"] for s in got["replicas"].values()) == [1, 3]
    _send_burst(cluster, 4, "after")
    after = _metrics(cluster)

    def routed(metrics: dict[str, float], rid: str) -> float:
        return sum(v for k, v in metrics.items()
                   if k.startswith("everystop_router_requests_total") and f'replica="{rid}"' in k)

    sent = {rid: routed(after, rid) - routed(before, rid) for rid in replicas}
    assert sum(sent.values()) == 4 and min(sent.values()) >= 1, (sent, after)
