"""/openapi.json describing the real request bodies.

The routes read raw bytes (our own limits and strict parsing come first), so FastAPI cannot
see their body types; this adds each route's pydantic model as its request body, and the
error responses every route may give, so client generators and schema-driven fuzzers have
the true shapes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}
_ERRORS = {"400": "invalid request (the error names the field or limit)",
           "401": "missing or wrong API key", "404": "unknown model",
           "413": "body over --max-body-bytes", "415": "not JSON",
           "429": "busy: retry after Retry-After seconds", "500": "engine error",
           "503": "draining or engine dead"}


def install_openapi(app: FastAPI, bodies: dict[tuple[str, str], type[BaseModel]]) -> None:
    """`bodies`: (method, path) -> the model its JSON body is validated against."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = _ERROR
        for (method, path), model in bodies.items():
            body = model.model_json_schema(ref_template=_REF)
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            op = schema["paths"][path][method.lower()]
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=model.__name__)}}}}
            op.setdefault("responses", {}).update({
                code: {"description": text, "content": {"application/json": {
                    "schema": {"$ref": _REF.format(model="Error")}}}}
                for code, text in _ERRORS.items()})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
