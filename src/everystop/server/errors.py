"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with a status,
and a request id on every response (`X-Request-Id`) that the log's tracebacks carry too."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("everystop.server")
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # a caller's own id, echoed only if tame

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    """Raised anywhere in a route; becomes an OpenAI-style JSON error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, err_type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    """Every error path, including FastAPI's own (404 route, 405, validation), speaks OpenAI."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return bad_request(first.get("msg", "invalid request"), param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(http: Request, exc: Exception) -> JSONResponse:
        # The client gets the id, never the traceback: it may hold prompts or paths.
        rid = request_id(http)
        logger.error("internal error in %s %s [request %s]", http.method, http.url.path, rid,
                     exc_info=exc)
        return APIError(500, f"internal server error (request id {rid})",
                        headers={"X-Request-Id": rid}).response()


def request_id(http: Request) -> str:
    return str(http.scope.get("state", {}).get("request_id", "-"))


class RequestIdMiddleware:
    """Gives every request an id (the caller's `X-Request-Id` when it is a short plain token)
    and returns it as `X-Request-Id`. Pure ASGI, so streaming responses pass through as is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", ())).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)
