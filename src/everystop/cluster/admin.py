"""/admin on the cluster ingress. Each replica runs its own scheduler, so a config call fans out
to every replica, and a call the cluster cannot serve is refused by name: one replica's answer
is never passed off as the cluster's.

    GET   /admin/scheduler_config          every replica's config; `config` is the common one,
                                           or null with `consistent: false` when they differ
    PATCH /admin/scheduler_config          applied replica by replica, one PATCH at a time; the
                                           first refusal (a bad value: 400) changes nothing
                                           anywhere; a failure after some applied is a 502
                                           naming which replicas changed
    GET   /admin/scheduler_config/history  501: the history lives in the telemetry store,
                                           which cluster mode does not run
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from everystop.cluster.front import ClusterEngine
from everystop.server.admin import ADJUSTABLE
from everystop.server.errors import APIError
from everystop.server.limits import loads


def _error(status: int, message: str, code: str, err_type: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": None,
                                   "code": code}}, status_code=status)


def _merged(snapshots: dict[str, dict[str, Any]]) -> dict[str, Any]:
    configs = [s["config"] for s in snapshots.values()]
    same = all(c == configs[0] for c in configs)
    return {"object": "scheduler_config", "consistent": same,
            "config": configs[0] if same else None, "adjustable": list(ADJUSTABLE),
            "replicas": snapshots}


def install_cluster_admin(app: FastAPI, front: ClusterEngine) -> None:
    """The /admin routes (who may call them: server/access.py)."""
    patching = asyncio.Lock()  # two PATCHes interleaved over replicas would leave them differing

    @app.get("/admin/scheduler_config")
    async def get_scheduler_config() -> Any:
        replicas = front.replica_ids()
        if not replicas:
            return _error(503, "no replica is running", "no_replica")
        answers = {rid: await front.replica_admin("get", rid) for rid in replicas}
        failed = [f"{rid}: {a['body']['error']['message']}" for rid, a in answers.items()
                  if a["status"] != 200]
        if failed:
            return _error(503, "not every replica answered, so the cluster's config is "
                          f"unknown ({'; '.join(failed)})", "replica_unavailable")
        return _merged({rid: a["body"] for rid, a in answers.items()})

    @app.patch("/admin/scheduler_config")
    async def patch_scheduler_config(request: Request) -> Any:
        try:
            body = loads(await request.body(), max_depth=4)
        except APIError as exc:
            return exc.response()
        async with patching:
            replicas = front.replica_ids()
            if not replicas:
                return _error(503, "no replica is running", "no_replica")
            applied: dict[str, dict[str, Any]] = {}
            for rid in replicas:
                answer = await front.replica_admin("patch", rid, body)
                if answer["status"] == 200:
                    applied[rid] = answer["body"]
                    continue
                if not applied:  # refused by the first replica: nothing changed anywhere
                    return JSONResponse(answer["body"], status_code=answer["status"])
                rest = [r for r in replicas if r not in applied]
                return _error(502, f"the change was applied on {sorted(applied)} but not on "
                              f"{rest} ({rid}: {answer['body']['error']['message']}); the "
                              "replicas' configs now differ (GET shows each)",
                              "partially_applied")
            return _merged(applied)

    @app.get("/admin/scheduler_config/history")
    async def scheduler_config_history() -> Any:
        return _error(501, "the config history lives in the telemetry store, which the "
                      "cluster ingress (--replicas) does not run; GET /admin/scheduler_config "
                      "shows each replica's current version", "unsupported_in_cluster_mode",
                      "invalid_request_error")
