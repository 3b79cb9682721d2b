"""Hot-reloadable scheduler config over HTTP: validated like start-up, applied at the next
iteration under load without losing work, every version recorded; telemetry wired to an app."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from everystop.engine.async_engine import AsyncEngine
from everystop.server.access import AccessPolicy, install_access
from everystop.server.admin import install_admin_routes, install_telemetry
from everystop.telemetry.rows import ConfigRow, SequenceRow
from everystop.telemetry.service import Telemetry
from everystop.telemetry.store import Store, open_store
from tests.core.toy_executor import ToyExecutor, reference_output

from .helpers import SlowExecutor, make_engine, params

KEY = {"Authorization": "Bearer s3cret"}


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def consume(front: AsyncEngine, prompt: str, n: int) -> list[int]:
    got: list[int] = []
    async for out in front.generate(prompt, params(n)):
        got.extend(out.new_token_ids)
    return got


@pytest.mark.parametrize("body, param", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": 100}, "max_num_seqs"),  # budget 64 < 100 seqs: the start-up rule
    ({"max_num_batched_tokens": 4}, "max_num_batched_tokens"),
    ({"chunk_size": -1}, "chunk_size"),
    ({"max_num_seqs": "4"}, "max_num_seqs"),
    ({"max_num_seqs": True}, "max_num_seqs"),
    ({"watermark": 0.7}, "watermark"),
    ({"max_queued_per_tier": [1, 2]}, "max_queued_per_tier"),
    ({"max_queued_per_tenant": -3}, "max_queued_per_tenant"),
    ({"max_model_len": 8}, "max_model_len"),  # not adjustable at runtime
    ({"tpot_target_ms": -5}, "tpot_target_ms"),
    ({"tpot_target_ms": "fast"}, "tpot_target_ms"),
    ({"tpot_target_ms_per_tier": [50, 100]}, "tpot_target_ms_per_tier"),
    ({}, None),
])
def test_bad_values_get_400_and_change_nothing(store: Store, body: dict, param: str) -> None:
    eng = make_engine()
    front = AsyncEngine(eng)
    app = FastAPI()
    install_access(app, AccessPolicy(admin_key="s3cret"))
    install_admin_routes(app, front, store=store)
    before = eng.scheduler.config

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with client(app) as c:
            bad = await c.patch("/admin/scheduler_config", json=body, headers=KEY)
            return bad, await c.get("/admin/scheduler_config", headers=KEY)

    try:
        bad, now = asyncio.run(main())
    finally:
        front.shutdown()
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert eng.scheduler.config is before and eng.kv.watermark_blocks == 0
    assert now.json()["version"] == 1
    assert [r.source for r in store.fetch(ConfigRow)] == ["startup"]


def test_admin_key_is_required_when_set() -> None:
    eng = make_engine()
    front = AsyncEngine(eng)
    app = FastAPI()
    install_access(app, AccessPolicy(admin_key="s3cret"))
    install_admin_routes(app, front)

    async def main() -> list[int]:
        async with client(app) as c:
            return [(await c.get("/admin/scheduler_config")).status_code,
                    (await c.get("/admin/scheduler_config",
                                 headers={"Authorization": "Bearer wrong"})).status_code,
                    (await c.patch("/admin/scheduler_config",
                                   json={"max_num_seqs": 2})).status_code,
                    (await c.get("/admin/scheduler_config", headers=KEY)).status_code,
                    (await c.get("/admin/scheduler_config",
                                 headers={"X-Admin-Key": "s3cret"})).status_code]

    try:
        assert asyncio.run(main()) == [401, 401, 401, 200, 200]
    finally:
        front.shutdown()
    assert eng.scheduler.config.max_num_seqs == 8


class HeldAfterAFullBatch(SlowExecutor):
    """After its first pass of `full` sequences, holds every later pass until `go` is set:
    the patch then lands mid-run however slowly the client gets to it (the forward pass runs
    outside the engine's lock, so the config switch does not wait on the held pass)."""

    def __init__(self, inner: ToyExecutor, pause_s: float, full: int) -> None:
        super().__init__(inner, pause_s)
        self.full = full
        self.saw_full = False
        self.go = threading.Event()

    def execute(self, sched: Any) -> Any:
        if self.saw_full:
            assert self.go.wait(timeout=60), "the test never let the run go on"
        out = super().execute(sched)
        self.saw_full = self.saw_full or len(sched.scheduled) == self.full
        return out


def test_patch_max_num_seqs_down_under_load(store: Store) -> None:
    executor = HeldAfterAFullBatch(ToyExecutor(256, 4), 0.002, full=8)
    eng = make_engine(executor=executor, max_num_seqs=8)
    steps: list[tuple[int, int, int]] = []  # (step, sequences in the pass, running after it)
    eng.iteration_listeners.append(
        lambda rec, sched: steps.append((rec.step, rec.num_seqs, rec.num_running)))
    front = AsyncEngine(eng)
    telemetry = Telemetry(store, front, monitor=True)
    app = FastAPI()
    install_access(app, AccessPolicy(admin_key="s3cret"))
    install_admin_routes(app, front, store=store)
    prompts = [f"request number {i}" for i in range(24)]

    async def main() -> tuple[dict[str, Any], list[list[int]], dict[str, Any]]:
        async with client(app) as c:
            tasks = [asyncio.create_task(consume(front, p, 40)) for p in prompts]
            while not any(n == 8 for _, n, _ in steps):  # load: a full batch of 8
                await asyncio.sleep(0.005)
            patched = await c.patch("/admin/scheduler_config", json={"max_num_seqs": 2},
                                    headers=KEY)
            executor.go.set()
            assert patched.status_code == 200, patched.text
            outs = await asyncio.gather(*tasks)
            got = await c.get("/admin/scheduler_config", headers=KEY)
            return patched.json(), outs, got.json()

    try:
        patched, outs, got = asyncio.run(main())
    finally:
        executor.go.set()
        front.shutdown()
    switch = patched["applied_after_step"]
    assert patched["version"] == 2 and patched["config"]["max_num_seqs"] == 2
    assert max(n for s, n, _ in steps if s <= switch) == 8
    # One pass may have been scheduled before the switch and finished after; every pass
    # scheduled later respects the new cap.
    later = [(n, r) for s, n, r in steps if s > switch + 1]
    assert later and max(n for n, _ in later) <= 2 and max(r for _, r in later) <= 2
    for prompt, out in zip(prompts, outs):  # nothing lost: full, exact outputs
        assert out == reference_output([ord(ch) for ch in prompt], 40)
    assert got["version"] == 2 and got["config"]["max_num_seqs"] == 2
    assert telemetry.writer.flush()
    versions = store.fetch(ConfigRow)
    assert [(v.version, v.source, v.max_num_seqs) for v in versions] == [
        (1, "startup", 8), (2, "admin", 2)]
    assert json.loads(versions[1].config_json)["max_num_seqs"] == 2
    assert store.count(SequenceRow) == len(prompts)
    telemetry.close()


def test_patch_watermark_and_queue_limits(store: Store) -> None:
    eng = make_engine(executor=SlowExecutor(ToyExecutor(256, 4), 0.005))
    front = AsyncEngine(eng, watchdog_interval_s=60.0)
    app = FastAPI()
    install_admin_routes(app, front, store=store)

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with client(app) as c:
            # a live request that may grow to 201 of the 256 blocks
            big = front.make_request("big", params(800))
            front.submit(big)
            too_high = await c.patch("/admin/scheduler_config", json={"watermark": 0.4})
            front.abort(big.request_id)
            assert too_high.status_code == 400 and "needs up to 201" in too_high.text
            assert too_high.json()["error"]["param"] == "watermark"
            ok = await c.patch("/admin/scheduler_config",
                               json={"watermark": 0.25, "max_queued_per_tier": [0, 3, 1],
                                     "max_queued_per_tenant": 5, "tpot_target_ms": 80,
                                     "tpot_target_ms_per_tier": [40, None, 0]})
            return ok, await c.get("/admin/scheduler_config/history")

    try:
        ok, history = asyncio.run(main())
    finally:
        front.shutdown()
    assert ok.status_code == 200, ok.text
    assert ok.json()["config"]["watermark"] == 0.25
    assert eng.kv.watermark_blocks == 64 and eng.config.cache.watermark == 0.25
    assert eng.scheduler.config.max_queued_per_tier == (0, 3, 1)
    assert eng.scheduler.config.max_queued_per_tenant == 5
    assert eng.scheduler.config.tpot_target_ms == 80.0
    assert eng.scheduler.config.tpot_target_ms_per_tier == (40.0, None, 0.0)
    assert ok.json()["config"]["tpot_target_ms_per_tier"] == [40.0, None, 0.0]
    data = history.json()["data"]
    assert [(d["version"], d["kv_watermark_pct"], d["max_queued_per_tier"]) for d in data] == [
        (1, 0.0, "0,0,0"), (2, 0.25, "0,3,1")]


def test_install_telemetry_records_and_closes_with_the_app(store_target: str) -> None:
    eng = make_engine()
    front = AsyncEngine(eng)
    app = FastAPI()
    registry = CollectorRegistry()
    telemetry = install_telemetry(app, front, db=store_target, registry=registry,
                                  model_version="toy")

    async def main() -> list[int]:
        async with app.router.lifespan_context(app):
            return await consume(front, "hello", 6)

    try:
        out = asyncio.run(main())
    finally:
        front.shutdown()
    assert out == reference_output([ord(c) for c in "hello"], 6)
    assert telemetry.store._conn is None  # closed at shutdown, after flushing
    written = {s.labels.get("table"): s.value for f in registry.collect() for s in f.samples
               if s.name == "everystop:telemetry_rows_written_total"}
    assert written["sequences"] == 1 and written["scheduler_iterations"] == eng.num_steps
    reopened = open_store(store_target)
    try:
        [row] = reopened.fetch(SequenceRow)
        assert (row.generated_tokens, row.model_version) == (6, "toy")
    finally:
        reopened.close()
