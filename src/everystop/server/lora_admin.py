"""Loading and unloading LoRA adapters while serving, as vLLM names the routes (operator
routes: server/access.py). An adapter in use is not unloaded: 409 until its requests finish."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from everystop.engine.client import EngineAdmin
from everystop.engine.lora_registry import LoraConflict, UnknownLoraAdapter
from everystop.server.errors import APIError, bad_request
from everystop.server.limits import loads

MAX_BODY_DEPTH = 4


def install_lora_routes(app: FastAPI, engine: EngineAdmin) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        name, path = _fields(await request.body(), "lora_name", "lora_path")
        try:
            await asyncio.to_thread(engine.load_lora, name, path)  # reads the adapter's files
        except LoraConflict as exc:
            raise APIError(409, str(exc), param="lora_name", code="lora_adapter_exists") from None
        except ValueError as exc:  # the adapter's files: missing, unsupported, wrong base
            raise bad_request(str(exc), "lora_path", code="invalid_lora_adapter") from None
        return JSONResponse({"object": "lora_adapter", "id": name, "loaded": True})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        (name,) = _fields(await request.body(), "lora_name")
        try:
            await asyncio.to_thread(engine.unload_lora, name)
        except UnknownLoraAdapter as exc:
            raise APIError(404, str(exc), param="lora_name", code="model_not_found") from None
        except LoraConflict as exc:
            raise APIError(409, str(exc), param="lora_name", code="lora_adapter_in_use") from None
        return JSONResponse({"object": "lora_adapter", "id": name, "loaded": False})


def _fields(raw: bytes, *names: str) -> tuple[str, ...]:
    """The named string fields of a JSON object body, each required and non-empty."""
    body: Any = loads(raw, max_depth=MAX_BODY_DEPTH)
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", None)
    values = []
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise bad_request(f"{name} must be a non-empty string", name)
        values.append(value)
    return tuple(values)
