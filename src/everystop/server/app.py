"""The OpenAI-compatible FastAPI app. Routes are thin: parse, check, hand to `serving`.

`build_app` is the extension point: pass `extensions`, callables taking (app, async_engine)
that add routes or listeners (the observability layer adds /admin and a telemetry store).
Everything a route needs lives on `app.state.ctx` (a ServingContext).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from everystop.engine.client import EngineClient
from everystop.server.access import AccessPolicy, install_access
from everystop.server.admission import AdmissionConfig, AdmissionController
from everystop.server.chat_prompt import render_chat
from everystop.server.errors import APIError, RequestIdMiddleware, install_error_handlers
from everystop.server.formatting import ChatFormat, CompletionFormat
from everystop.server.limits import LimitsMiddleware, RequestLimits, check_fan_out
from everystop.server.loop_lag import LoopLagMonitor
from everystop.server.metrics import CONTENT_TYPE, ServerMetrics
from everystop.server.offload import PrepLimits, PrepPool, json_with_ids
from everystop.server.openapi import install_openapi
from everystop.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    model_info,
    model_list,
    parse_body,
)
from everystop.server.responses_api import (
    ResponseBuilder,
    ResponsesRequest,
    parse_chat,
    stream,
)
from everystop.server.serving import ServingContext, generate
from everystop.server.streaming import SSEResponse

Extension = Callable[[FastAPI, EngineClient], Any]
logger = logging.getLogger("everystop.server")


class RouteGuards:
    """What every route checks before its own work (its caller's key was checked before it,
    by server/access.py): the model's name, the body."""

    def __init__(self, served_model_name: str, aliases: Iterable[str],
                 limits: RequestLimits, prep: PrepPool,
                 adapters: Callable[[], list[str]] = list) -> None:
        self.served_model_name = served_model_name
        # Other names the model answers to (e.g. the file's full stem); responses use the first.
        self.known = {served_model_name, *aliases}
        self.adapters = adapters  # the LoRA adapters served now, by name
        self.limits = limits
        self.prep = prep

    async def parse(self, http: Request, model: type[Any]) -> Any:
        raw = await http.body()
        return await self.prep.run(parse_body, raw, model, self.limits.max_json_depth,
                                   self.limits.max_token_ids, size=len(raw))

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.known and name not in self.adapters():
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", param="model",
                           code="model_not_found")

    def response_model(self, name: str | None) -> str:
        """The `model` a response names: the adapter asked for, else the base's name."""
        return name if name is not None and name in self.adapters() else self.served_model_name


def build_app(async_engine: EngineClient, served_model_name: str, *,
              aliases: Iterable[str] = (), api_key: str | None = None,
              admin_key: str | None = None, admission: AdmissionConfig | None = None,
              metrics: ServerMetrics | None = None,
              max_n: int = 8, extensions: Iterable[Extension] = (),
              limits: RequestLimits | None = None, open_metrics: bool = False,
              prep: PrepLimits | None = None) -> FastAPI:
    """`api_key`, `admin_key`, `open_metrics`: who may call what (server/access.py; /metrics
    without the API key when `open_metrics`: a scraper on a private network); `prep`: the
    request-preparation workers' limits (server/offload.py)."""
    app = FastAPI(title="everystop", docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    install_error_handlers(app)
    limits = limits or RequestLimits()
    app.add_middleware(LimitsMiddleware, limits=limits)
    policy = AccessPolicy(api_key=api_key, admin_key=admin_key, open_metrics=open_metrics)
    install_access(app, policy)  # before the limits: a caller without a key learns nothing
    logger.info("%s", policy.describe())
    app.add_middleware(RequestIdMiddleware)  # outermost: limit refusals carry an id too
    metrics = metrics or ServerMetrics()
    metrics.attach(async_engine, model_name=served_model_name)
    controller = AdmissionController(
        admission or AdmissionConfig(),
        max_num_seqs=lambda: async_engine.scheduler_config.max_num_seqs,
        num_running=lambda: async_engine.num_running)
    ctx = ServingContext(async_engine, served_model_name, controller, metrics, max_n,
                         PrepPool(prep))
    app.state.ctx = ctx
    app.state.engine = async_engine
    app.state.loop_lag = LoopLagMonitor([metrics.observe_loop_lag])
    _run_with_app(app, ctx, app.state.loop_lag)
    guards = RouteGuards(served_model_name, aliases, limits, ctx.prep,
                         async_engine.lora_adapters)
    add_generation_routes(app, ctx, guards)
    add_model_routes(app, async_engine.max_model_len, guards)
    add_tokenizer_routes(app, async_engine, guards)
    add_health_and_metrics_routes(app, async_engine, metrics)
    for extend in extensions:
        extend(app, async_engine)
    install_openapi(app, {("POST", "/v1/completions"): CompletionRequest,
                          ("POST", "/v1/chat/completions"): ChatCompletionRequest,
                          ("POST", "/v1/responses"): ResponsesRequest,
                          ("POST", "/tokenize"): TokenizeRequest})
    return app


def add_generation_routes(app: FastAPI, ctx: ServingContext, guards: RouteGuards) -> None:
    """/v1/completions and /v1/chat/completions: parse, check, hand to `serving.generate`."""
    async_engine = ctx.engine
    tokenizer = async_engine.tokenizer
    limits = guards.limits

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        body: CompletionRequest = await guards.parse(http, CompletionRequest)
        guards.check_model(body.model)
        prompts = body.prompts()
        check_fan_out(limits, len(prompts), body.n)
        fmt = CompletionFormat(guards.response_model(body.model), tokenizer)
        return await generate(ctx, http, body, prompts, fmt)

    @app.post("/v1/responses")
    async def responses(http: Request) -> Response:
        req: ResponsesRequest = await guards.parse(http, ResponsesRequest)
        guards.check_model(req.model)
        body = parse_chat(req)
        check_fan_out(limits, 1, body.n)
        prompt = await ctx.prep.run(render_chat, async_engine, body,
                                    size=len(await http.body()))
        model = guards.response_model(req.model)
        fmt = ChatFormat(model, tokenizer, body.tool_names(), body.parallel)
        chat = await generate(ctx, http, body, [prompt], fmt, default_max_tokens_to_len=True)
        builder = ResponseBuilder(req, model)
        if isinstance(chat, SSEResponse):
            return stream(builder, chat)
        if chat.status_code != 200:
            return chat
        return JSONResponse(builder.from_chat(json.loads(bytes(chat.body))))

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        body: ChatCompletionRequest = await guards.parse(http, ChatCompletionRequest)
        guards.check_model(body.model)
        check_fan_out(limits, 1, body.n)
        ctx.metrics.count_ignored_fields(body.ignored_fields)
        prompt = await ctx.prep.run(render_chat, async_engine, body,
                                    size=len(await http.body()))
        fmt = ChatFormat(guards.response_model(body.model), tokenizer, body.tool_names(),
                         body.parallel, body.echoed_text())
        return await generate(ctx, http, body, [prompt], fmt, default_max_tokens_to_len=True)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    vocab = tokenizer.vocab_size
    if any(t >= vocab for t in ids):
        raise APIError(400, f"tokens: ids must be < {vocab}", param="tokens")
    text: str = tokenizer.decode(ids, skip_special_tokens=False)
    return text


def _run_with_app(app: FastAPI, ctx: ServingContext, monitor: LoopLagMonitor) -> None:
    """The loop-lag monitor runs, and the preparation workers live, as long as the app."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        monitor.start()
        try:
            async with inner(a) as state:
                yield state
        finally:
            await monitor.stop()
            ctx.prep.shutdown()

    app.router.lifespan_context = lifespan


def add_model_routes(app: FastAPI, max_model_len: int, guards: RouteGuards) -> None:
    """/v1/models and /v1/models/{id}: the served model's card."""
    served_model_name = guards.served_model_name

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(model_list(served_model_name, max_model_len, guards.adapters()))

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> JSONResponse:
        guards.check_model(model_id)
        parent = served_model_name if model_id in guards.adapters() else None
        return JSONResponse(model_info(model_id, max_model_len, parent))


def add_tokenizer_routes(app: FastAPI, async_engine: EngineClient, guards: RouteGuards) -> None:
    """vLLM-style helpers over the served model's tokenizer."""
    tokenizer = async_engine.tokenizer
    max_model_len = async_engine.max_model_len
    prep = guards.prep

    @app.post("/tokenize")
    async def tokenize(http: Request) -> Response:
        """vLLM-style helper: {"prompt": str} -> {"tokens": [...], "count", "max_model_len"}."""
        body = await guards.parse(http, TokenizeRequest)
        guards.check_model(body.model)
        ids = await prep.run(tokenizer.encode, body.prompt, size=len(body.prompt),
                             add_special_tokens=bool(body.add_special_tokens))
        fields = {"count": len(ids), "max_model_len": max_model_len}
        return Response(await prep.run(json_with_ids, ids, fields, size=len(ids)),
                        media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(http: Request) -> JSONResponse:
        """vLLM-style helper: {"tokens": [...]} -> {"prompt": str} (special tokens kept)."""
        body = await guards.parse(http, DetokenizeRequest)
        guards.check_model(body.model)
        text = await prep.run(_decode, tokenizer, body.tokens, size=len(body.tokens))
        return JSONResponse({"prompt": text})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        """vLLM-style helper: lm-eval's local-completions finds it and tokenizes remotely."""
        info = getattr(tokenizer, "info", None)
        if info is None:
            raise APIError(404, "this tokenizer does not describe itself", code="not_found")
        return JSONResponse({**info(), "model_max_length": max_model_len})


def add_health_and_metrics_routes(app: FastAPI, async_engine: EngineClient,
                                  metrics: ServerMetrics) -> None:
    """/health and /metrics (who may call them: server/access.py)."""

    @app.get("/health")
    async def health() -> Response:
        state = async_engine.health()
        if state.status == "dead":
            return JSONResponse({"status": "dead", "error": state.error}, 503)
        if state.status == "draining":
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        """vLLM's: the server's version (no key, as /health)."""
        from everystop import __version__

        return JSONResponse({"version": __version__})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness probe: /health's answer."""
        return await health()

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        raise APIError(404, "embeddings are not served: this server runs a generative model "
                            "(use /v1/completions or /v1/chat/completions)",
                       code="embeddings_not_served")

    @app.get("/metrics")
    async def prometheus() -> Response:
        # Off the loop: with per-tenant histograms the text runs to hundreds of KB.
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)
