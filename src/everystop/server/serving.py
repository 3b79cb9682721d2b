"""One HTTP generation request end to end: OpenAI fields -> engine requests (prompts x n) ->
admission -> submit -> a streamed (SSE) or a collected JSON response.

Every engine request is aborted on every exit path that does not see it finish: a client that
leaves (stream cancelled, or the disconnect watcher for non-streamed calls), a failed sibling
submit, an engine error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from everystop.core.outputs import RequestOutput
from everystop.core.request import Request
from everystop.core.scheduler import QueueFull, RequestRejected
from everystop.engine.async_engine import EngineDead, EngineDraining
from everystop.engine.client import EngineClient
from everystop.engine.grammar_compiler import GrammarCompilerBusy
from everystop.engine.grammar_limits import SpecOverLimit
from everystop.engine.lora_registry import UnknownLoraAdapter
from everystop.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    StructuredOutputError,
)
from everystop.server.admission import (
    AdmissionController,
    AdmissionRefused,
    retry_after_header,
)
from everystop.server.errors import APIError, bad_request
from everystop.server.formatting import CompletionFormat, Format, prompt_logprobs
from everystop.server.metrics import ServerMetrics
from everystop.server.offload import INLINE_SIZE, PrepPool, make_request
from everystop.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _GenerationRequest,
    usage_dict,
)
from everystop.server.streaming import DONE, SSEResponse, sse
from everystop.server.tenants import clean_tenant


@dataclass
class ServingContext:
    engine: EngineClient
    model_name: str
    admission: AdmissionController
    metrics: ServerMetrics
    max_n: int = 8
    prep: PrepPool = dataclasses.field(default_factory=PrepPool)


@dataclass
class _Choice:
    index: int
    req: Request
    prompt_index: int
    text: str = ""
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    out: RequestOutput | None = None
    last_token_at: float | None = None
    echo: str | None = None  # the prompt's text, when /v1/completions echoes it
    score_only: bool = False  # max_tokens 0 with echo: what was sampled is not returned
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for


def _echo_offset(c: _Choice) -> int:
    return len(c.echo or "")


def _with_echo(fmt: Format, c: _Choice, text: str, lp: dict[str, Any] | None,
               out: RequestOutput | None) -> tuple[str, dict[str, Any] | None]:
    if c.echo is None or not isinstance(fmt, CompletionFormat):
        return text, lp
    scored = out.prompt_logprobs if out is not None else None
    return fmt.with_echo(c.echo, c.req.prompt_token_ids, scored, text, lp)


def sampling_params(body: _GenerationRequest, num_logprobs: int | None) -> SamplingParams:
    constraint = body.structured_output()
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens == 0:
        # Score the prompt only. The engine samples at least one token, but that one comes
        # from the prefill pass's own last logits and ends the request in the same step: no
        # decode step runs; the token is dropped from the response.
        max_tokens = 1
    opts: dict[str, Any] = dict(
        max_tokens=max_tokens or max(16, body.min_tokens or 0),  # room for min_tokens
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
        logprobs=num_logprobs, presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_p=body.min_p or 0.0, min_tokens=body.min_tokens or 0,
        logit_bias=dict(body.logit_bias or {}),
        # Echo with logprobs scores the prompt too (lm-eval's loglikelihood).
        prompt_logprobs=_num_prompt_logprobs(body, num_logprobs),
        structured_output=constraint[1] if constraint else None,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        allowed_token_ids=None if body.allowed_token_ids is None else
        list(body.allowed_token_ids), bad_words=list(body.bad_words or []),
        disable_spec_decode=body.disable_spec_decode)
    try:
        return SamplingParams(**opts)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), _field(body, exc)) from None


def _field(body: _GenerationRequest, exc: SamplingParamsError) -> str | None:
    """The request field a SamplingParamsError names, when the body has such a field."""
    return exc.param if exc.param in type(body).model_fields else None


def tenant_of(http: HTTPRequest, body: _GenerationRequest) -> str:
    return clean_tenant(http.headers.get("x-tenant-id") or body.user or "default")


async def generate(ctx: ServingContext, http: HTTPRequest, body: _GenerationRequest,
                   prompts: list[str | list[int]], fmt: Format,
                   default_max_tokens_to_len: bool = False) -> Response:
    """Run `prompts` x body.n through the engine and answer in `fmt`'s shape."""
    if body.n > ctx.max_n:
        raise bad_request(f"n must be <= {ctx.max_n}", "n")
    if ctx.engine.draining:
        raise APIError(503, "the server is shutting down", code="draining")
    fmt.token_text.as_ids = body.return_tokens_as_token_ids
    tenant = tenant_of(http, body)
    # Chat without a limit: up to the context window, as OpenAI does.
    to_context = (default_max_tokens_to_len and body.max_tokens is None
                  and getattr(body, "max_completion_tokens", None) is None)
    prepare = functools.partial(_prepare, ctx, body, prompts, tenant, to_context)
    if body.constrained or len(await http.body()) > INLINE_SIZE:
        choices = await ctx.prep.run_always(prepare)  # tokenizing, compiling a grammar
    else:
        choices = prepare()
    await _admit(ctx, choices, body.priority)
    if body.stream:
        return SSEResponse(_stream_events(ctx, body, fmt, choices))
    return await _respond_when_done(ctx, http, fmt, choices)


def _prepare(ctx: ServingContext, body: _GenerationRequest, prompts: list[str | list[int]],
             tenant: str, to_context: bool) -> list[_Choice]:
    """The engine requests of `prompts` x body.n, tokenized (each prompt once; its n copies
    reuse the ids) and with their grammar compiled. Blocking: large or constrained requests run
    it on a PrepPool worker."""
    num_logprobs = _num_logprobs(body)
    base = sampling_params(body, num_logprobs)
    model = getattr(body, "model", None)
    lora = model if model is not None and model in ctx.engine.lora_adapters() else None
    choices: list[_Choice] = []
    for prompt_index, prompt in enumerate(prompts):
        for j in range(body.n):
            params = dataclasses.replace(base, seed=None if base.seed is None else base.seed + j)
            source = prompt if j == 0 else choices[-1].req.prompt_token_ids
            if j == 0 and isinstance(prompt, str) and getattr(body, "add_special_tokens", False):
                source = ctx.engine.tokenizer.encode(prompt, add_special_tokens=True)
            if j == 0 and body.truncate_prompt_tokens is not None:
                source = _truncated(ctx, source, body.truncate_prompt_tokens)
            try:
                req = make_request(ctx.engine, source, params, priority=body.priority,
                                   tenant=tenant, max_tokens_to_context=to_context, lora=lora)
            except UnknownLoraAdapter as exc:  # unloaded since the route checked the name
                raise APIError(404, str(exc), param="model", code="model_not_found") from None
            except SpecOverLimit as exc:
                field = body.structured_output()
                raise bad_request(str(exc), field[0] if field else None, code=exc.limit) from None
            except StructuredOutputError as exc:
                field = body.structured_output()
                raise bad_request(str(exc), field[0] if field else None) from None
            except GrammarCompilerBusy as exc:
                raise APIError(503, f"{exc}; retry later", code="grammar_compiler_busy",
                               headers={"Retry-After": "1"}) from None
            except SamplingParamsError as exc:  # a token id outside the model's vocabulary
                raise bad_request(str(exc), _field(body, exc)) from None
            except ValueError as exc:
                raise bad_request(str(exc), "prompt") from None
            echo = None
            if isinstance(body, CompletionRequest) and body.echo:
                echo = prompt if isinstance(prompt, str) else \
                    ctx.engine.tokenizer.decode(list(prompt))
            choices.append(_Choice(len(choices), req, prompt_index, echo=echo,
                                   score_only=bool(getattr(body, "scores_prompt_only", False)),
                                   prompt_logprobs=getattr(body, "prompt_logprobs", None)
                                   is not None))
    return choices


def _truncated(ctx: ServingContext, prompt: str | list[int], keep: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens."""
    if isinstance(prompt, str):
        prompt = ctx.engine.tokenizer.encode(prompt)
    return list(prompt[-keep:])


def _num_prompt_logprobs(body: _GenerationRequest, num_logprobs: int | None) -> int | None:
    """Echo with logprobs scores the prompt too (lm-eval's loglikelihood); so does vLLM's
    prompt_logprobs. Both asked: the larger number of alternatives serves both."""
    echoed = num_logprobs if isinstance(body, CompletionRequest) and body.echo else None
    asked: int | None = getattr(body, "prompt_logprobs", None)
    if echoed is None or asked is None:
        return echoed if asked is None else asked
    return max(echoed, asked)


def _num_logprobs(body: _GenerationRequest) -> int | None:
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs  # type: ignore[attr-defined]


async def _admit(ctx: ServingContext, choices: list[_Choice], tier: int) -> None:
    """Admission check, then submit all; on any refusal nothing stays queued."""
    try:
        ctx.admission.check(tier)
    except AdmissionRefused as exc:
        ctx.metrics.count_rejected(exc.reason, tier)
        raise APIError(429, str(exc), code="queue_wait_exceeded",
                       headers={"Retry-After": exc.retry_after_header}) from None
    submitted: list[Request] = []
    try:
        for c in choices:
            await ctx.engine.submit_async(c.req)
            submitted.append(c.req)
            ctx.admission.track(c.req)
    except BaseException as exc:
        for req in submitted:
            ctx.engine.abort(req.request_id)
            ctx.admission.done(req, completed=False)
        raise _map_submit_error(ctx, exc, tier) from None


def _map_submit_error(ctx: ServingContext, exc: BaseException, tier: int) -> BaseException:
    if isinstance(exc, QueueFull):
        reason = "tenant_queue" if "tenant" in exc.reason else "tier_queue"
        ctx.metrics.count_rejected(reason, tier)
        # The full queue's depth over its measured drain rate (the scheduler's estimate).
        return APIError(429, f"server busy: {exc.reason}; retry later", code="queue_full",
                        headers={"Retry-After": retry_after_header(exc.retry_after_s)})
    if isinstance(exc, RequestRejected):
        return bad_request(str(exc), "prompt", code="context_length_exceeded")
    if isinstance(exc, EngineDraining):
        return APIError(503, "the server is shutting down", code="draining")
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, UnknownLoraAdapter):  # unloaded between the request's making and now
        return APIError(404, str(exc), param="model", code="model_not_found")
    return exc


async def _merged(engine: EngineClient, choices: list[_Choice]
                  ) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
    """All choices' outputs in arrival order. Leaving early aborts the unfinished ones."""
    if len(choices) == 1:
        async for out in engine.stream(choices[0].req.request_id):
            yield choices[0], out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice) -> None:
        try:
            async for out in engine.stream(c.req.request_id):
                queue.put_nowait((c, out))
        except Exception as exc:
            queue.put_nowait((c, exc))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            c, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield c, item
            remaining -= item.finished
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _absorb(ctx: ServingContext, c: _Choice, out: RequestOutput) -> RequestOutput:
    """Accumulate one output into its choice and observe inter-token latency; returns the
    output as the response shows it."""
    if c.score_only:  # the prompt alone answers: the sampled token is dropped
        out = dataclasses.replace(out, new_token_ids=[], new_text="", token_ids=[], text="",
                                  new_logprobs=[], logprobs=[],
                                  finish_reason="length" if out.finish_reason in
                                  ("stop", "length") else out.finish_reason)
    c.out = out
    c.text += out.new_text
    c.logprobs.extend(out.new_logprobs)
    if out.new_token_ids:
        now = time.monotonic()
        if c.last_token_at is not None:
            ctx.metrics.observe_itl(c.req.priority, c.req.tenant, now - c.last_token_at,
                                    len(out.new_token_ids))
        c.last_token_at = now
    return out


def _usage(choices: list[_Choice]) -> dict[str, Any]:
    seen_prompts: set[int] = set()
    prompt = cached = completion = 0
    for c in choices:
        out = c.out
        completion += len(out.token_ids) if out else 0
        if c.prompt_index not in seen_prompts:  # n choices of one prompt count it once
            seen_prompts.add(c.prompt_index)
            prompt += c.req.num_prompt_tokens
            cached += out.num_cached_tokens if out else 0
    return usage_dict(prompt, completion, cached)


def _finish(ctx: ServingContext, choices: list[_Choice]) -> None:
    for c in choices:
        done = c.out is not None and c.out.finish_reason in ("stop", "length")
        ctx.admission.done(c.req, completed=done)


async def _stream_events(ctx: ServingContext, body: _GenerationRequest, fmt: Format,
                         choices: list[_Choice]) -> AsyncIterator[bytes]:
    want_lp = _num_logprobs(body) is not None
    started: set[int] = set()
    try:
        async for c, out in _merged(ctx.engine, choices):
            offset = len(c.text) + _echo_offset(c)
            out = _absorb(ctx, c, out)
            if out.finish_reason == "error":  # an engine fault ended this choice
                yield sse(_engine_error(out).body())
                continue
            first = c.index not in started
            if not (out.new_text or out.finished or first or (want_lp and out.new_logprobs)):
                continue  # text held back (partial UTF-8 or a possible stop string)
            started.add(c.index)
            if not (first or want_lp or out.finished or body.continuous_usage):
                frame = fmt.text_frame(c.index, out.new_text)  # the usual token: text only
                if frame is not None:
                    yield frame
                    continue
            lp = fmt.logprobs(out.new_logprobs, offset) if want_lp else None
            text = out.new_text
            if first:
                text, lp = _with_echo(fmt, c, text, lp, out)
            choice = fmt.chunk_choice(c.index, text, lp, out.finish_reason, first)
            chunk = fmt.body([choice], _usage(choices) if body.continuous_usage else None,
                             chunk=True)
            if first:
                _add_prompt_logprobs(fmt, c, choice, chunk)
            yield sse(chunk)
        if body.include_usage:
            yield sse(fmt.body([], _usage(choices), chunk=True))
    except EngineDead as exc:
        yield sse(APIError(503, str(exc), code="engine_dead").body())
    finally:
        _finish(ctx, choices)
    yield DONE


async def _respond_when_done(ctx: ServingContext, http: HTTPRequest, fmt: Format,
                             choices: list[_Choice]) -> Response:
    async def collect() -> None:
        async for c, out in _merged(ctx.engine, choices):
            _absorb(ctx, c, out)

    task = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_for_disconnect(http))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():  # the client left: cancelling the collector aborts its requests
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)
        try:
            task.result()
        except EngineDead as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        for c in choices:
            if c.out is not None and c.out.finish_reason == "error":
                raise _engine_error(c.out)
    finally:
        watcher.cancel()
        task.cancel()
        _finish(ctx, choices)
    want_lp = any(c.req.sampling_params.logprobs is not None for c in choices)
    out_choices: list[dict[str, Any]] = []
    body = fmt.body(out_choices, _usage(choices), chunk=False)
    for c in choices:
        lp = fmt.logprobs(c.logprobs, _echo_offset(c)) if want_lp else None
        text, lp = _with_echo(fmt, c, c.text, lp, c.out)
        choice = fmt.final_choice(c.index, text, lp, c.out.finish_reason if c.out else "abort")
        _add_prompt_logprobs(fmt, c, choice, body)
        out_choices.append(choice)
    return JSONResponse(body)


def _engine_error(out: RequestOutput) -> APIError:
    return APIError(500, out.error or "engine error", code="engine_error")


def _add_prompt_logprobs(fmt: Format, c: _Choice, choice: dict[str, Any],
                         body: dict[str, Any]) -> None:
    """vLLM's places: a completion choice carries its prompt's scores; a chat response (one
    prompt) carries them at the top level."""
    if not c.prompt_logprobs:
        return
    scored = c.out.prompt_logprobs if c.out is not None else None
    where = choice if isinstance(fmt, CompletionFormat) else body
    where["prompt_logprobs"] = prompt_logprobs(fmt.token_text, c.req.prompt_token_ids, scored)


async def _wait_for_disconnect(http: HTTPRequest) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
