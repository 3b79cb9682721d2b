"""Who may call what: every route's access class, and the one check every request passes
(`AccessMiddleware`, installed by `build_app` in front of all routes). docs/access.md has the
table per route; tests/server/test_auth_matrix.py checks this code against that table.

  class     no keys         --api-key only   --admin-key only   both keys
  public    anyone          anyone           anyone             anyone
  api       anyone          API key          anyone             API key
  operator  loopback only   API key          admin key          admin key
  page      loopback only   anyone           anyone             anyone

Closed by default: a route this module does not name is an operator route, and an operator
route is never open to the network. `page` is the dashboard's shell and assets: no numbers in
them (the data is an operator route), and a browser cannot put a key on a page load.

Keys: the API key as `Authorization: Bearer KEY`; the operator key (the admin key, or the API
key when there is no admin key) as `Authorization: Bearer KEY` or `X-Admin-Key: KEY`.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from everystop.server.errors import APIError


class Access(enum.Enum):
    PUBLIC = "public"
    API = "api"
    OPERATOR = "operator"
    PAGE = "page"


# By route template (FastAPI's path, as registered).
_ROUTES = {
    "/health": Access.PUBLIC, "/health/replicas": Access.PUBLIC,  # probes carry no key
    "/ping": Access.PUBLIC, "/version": Access.PUBLIC,
    "/docs": Access.PUBLIC, "/docs/oauth2-redirect": Access.PUBLIC,
    "/openapi.json": Access.PUBLIC,
    "/tokenize": Access.API, "/detokenize": Access.API, "/tokenizer_info": Access.API,
    "/dashboard": Access.PAGE, "/dashboard/static/{name}": Access.PAGE,
    "/dashboard/data": Access.OPERATOR,
    "/v1/load_lora_adapter": Access.OPERATOR, "/v1/unload_lora_adapter": Access.OPERATOR,
}
_PREFIXES = (("/v1/", Access.API), ("/admin/", Access.OPERATOR))
UNNAMED = "<a route with no template of its own>"


@dataclass(frozen=True)
class AccessPolicy:
    api_key: str | None = None
    admin_key: str | None = None
    open_metrics: bool = False  # /metrics without the API key (a scraper on a private network)

    def __post_init__(self) -> None:
        # An empty key would be matched by an empty (absent) one: open, not closed.
        if self.api_key == "" or self.admin_key == "":
            raise ValueError("an API or admin key must not be empty")

    def route_access(self, template: str | None) -> Access:
        """The class of the route registered as `template`; None (no route: a 404 to come)
        is treated as the API's."""
        if template is None:
            return Access.API
        if template == "/metrics":
            return Access.PUBLIC if self.open_metrics else Access.API
        if template in _ROUTES:
            return _ROUTES[template]
        for prefix, access in _PREFIXES:
            if template.startswith(prefix):
                return access
        return Access.OPERATOR

    @property
    def operator_key(self) -> str | None:
        return self.admin_key or self.api_key

    def refusal(self, access: Access, headers: dict[bytes, bytes],
                client_host: str | None) -> APIError | None:
        """None when the request may go on, else the error to answer."""
        if access is Access.API and self.api_key is not None:
            if not _matches(_bearer(headers), self.api_key):
                return APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                code="invalid_api_key")
        elif access is Access.OPERATOR and self.operator_key is not None:
            given = headers.get(b"x-admin-key") or _bearer(headers)
            if not _matches(given, self.operator_key):
                which = "admin" if self.admin_key else "API"
                return APIError(401, f"this is an operator route: a valid {which} key is "
                                "required (Authorization: Bearer or X-Admin-Key)",
                                code="invalid_admin_key", err_type="authentication_error")
        elif (access is Access.OPERATOR or (access is Access.PAGE and self.operator_key is None)
              ) and not is_loopback(client_host):
            return APIError(403, "this is an operator route and no key is set: it answers "
                            "loopback clients only (start the server with --admin-key or "
                            "--api-key to reach it over the network)",
                            code="operator_route_loopback_only", err_type="permission_error")
        return None

    def describe(self) -> str:
        """One line for the start-up log."""
        api = "need the API key" if self.api_key else "are open to anyone who can connect"
        if self.operator_key is None:
            ops = "answer loopback clients only (no key set)"
        else:
            ops = "need the " + ("admin key" if self.admin_key else "API key")
        metrics = "open" if self.open_metrics or not self.api_key else "behind the API key"
        return (f"access: /v1 and the tokenizer routes {api}; operator routes (/admin, "
                f"/dashboard/data) {ops}; /metrics {metrics}; /health open")


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return bool(addr.is_loopback or (mapped is not None and mapped.is_loopback))


def _bearer(headers: dict[bytes, bytes]) -> bytes:
    auth = headers.get(b"authorization", b"")
    return auth[7:].strip() if auth[:7].lower() == b"bearer " else b""


def _matches(given: bytes, key: str) -> bool:
    return hmac.compare_digest(given, key.encode())


def route_template(scope: Scope) -> str | None:
    """The path template of the app's route that will serve `scope` (a method mismatch
    counts: its 405 is the route's), or None. A match without a template of its own (an
    included router) is UNNAMED: an operator route, the closed default."""
    partial = None
    for route in scope["app"].router.routes:
        match, _ = route.matches(scope)
        if match is Match.NONE:
            continue
        template = str(getattr(route, "path", UNNAMED))
        if match is Match.FULL:
            return template
        partial = partial or template
    return partial


class AccessMiddleware:
    """Pure ASGI: checks the caller against its route's class before anything else runs."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            access = self.policy.route_access(route_template(scope))
            headers = {k.lower(): v for k, v in scope.get("headers", ())}
            client = scope.get("client")
            refusal = self.policy.refusal(access, headers, client[0] if client else None)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_access(app: Starlette, policy: AccessPolicy) -> None:
    """Put `policy` in front of every route of `app` (outside any middleware added before)."""
    app.add_middleware(AccessMiddleware, policy=policy)
    app.state.access = policy
