"""`everystop bench serve`: replay a workload against any OpenAI-compatible server, streaming.

Works unchanged against everystop, vLLM and llama.cpp's server: it speaks only the public
completions / chat-completions API with `stream: true`, plus `ignore_eos` (a vLLM extension
llama.cpp also honours) so output lengths are exactly `max_tokens`. The tenant goes in the
standard `user` field; the priority tier is sent only when asked (vLLM rejects a non-zero
`priority` unless it runs its priority scheduler).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from everystop.bench.metrics import SLO, RequestResult, full_report
from everystop.workload import Workload, WorkloadRequest, arrival_offsets


@dataclass
class ServeOptions:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # or "chat"
    model: str | None = None  # None: the first id from GET /v1/models
    rate: float | None = math.inf  # req/s; inf = all at once; None = the workload's arrival_s
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    send_priority: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    # Request id -> prompt token ids, sent instead of the text (completions only): every server
    # then sees exactly the same tokens, whatever its tokenizer does with the text.
    prompt_token_ids: dict[str, list[int]] | None = None
    # Tenant -> the model its requests name (e.g. LoRA adapters served beside the base);
    # other tenants' requests name `model`.
    model_by_tenant: dict[str, str] = field(default_factory=dict)


def api_root(base_url: str) -> str:
    """'http://h:p', 'http://h:p/' and 'http://h:p/v1' all mean the same server."""
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def send_schedule(workload: Workload, opts: ServeOptions) -> list[float]:
    """When each request is due, in seconds from the start."""
    n = len(workload.requests)
    if opts.rate is None:
        return [r.arrival_s or 0.0 for r in workload.requests]
    if math.isinf(opts.rate):
        return [0.0] * n
    return arrival_offsets(n, opts.rate, opts.burstiness, random.Random(opts.seed))


def request_body(req: WorkloadRequest, opts: ServeOptions, model: str) -> dict[str, Any]:
    model = opts.model_by_tenant.get(req.tenant, model)
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True,
                            "temperature": opts.temperature, "user": req.tenant}
    if opts.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    elif opts.prompt_token_ids is not None:
        body["prompt"] = opts.prompt_token_ids[req.id]
    else:
        body["prompt"] = req.prompt
    if opts.send_priority:
        body["priority"] = req.priority
    body.update(opts.extra_body)
    return body


def sse_lines(pending: bytes, chunk: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of an SSE stream so far, and the unfinished rest. Lines end at b"\n"
    only: httpx's iter_lines() also splits at U+2028, U+0085 and the like, which JSON leaves
    unescaped and which streamed text from random prompts does contain."""
    *lines, rest = (pending + chunk).split(b"\n")
    return [line.rstrip(b"\r") for line in lines], rest


async def sse_data(resp: httpx.Response) -> Any:
    """Each `data:` payload of a streamed response, as text (an async iterator)."""
    pending = b""
    async for chunk in resp.aiter_bytes():
        lines, pending = sse_lines(pending, chunk)
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()


def _chunk_text(payload: dict[str, Any]) -> str:
    choices = payload.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    return (c.get("delta") or {}).get("content") or ""


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                     result: RequestResult, t0: float,
                     clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """Send one streaming request and time every content chunk. Fills `result` in place."""
    sent = clock()
    result.sent_s = sent - t0
    last = sent
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.success = False
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for data in sse_data(resp):
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if payload.get("usage"):
                    usage_tokens = payload["usage"].get("completion_tokens", usage_tokens)
                if not _chunk_text(payload):
                    continue
                now = clock()
                if chunks == 0:
                    result.ttft_s = now - sent
                else:
                    result.itl_s.append(now - last)
                last = now
                chunks += 1
        result.e2e_s = clock() - sent
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        if chunks == 0:
            result.success, result.error = False, "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.success, result.error = False, f"{type(exc).__name__}: {exc}"
    return result


async def discover_model(client: httpx.AsyncClient, root: str) -> str:
    try:
        resp = await client.get(f"{root}/v1/models")
        return str(resp.json()["data"][0]["id"])
    except Exception:  # servers that do not list models accept any name
        return "default"


async def run_serve(workload: Workload, opts: ServeOptions,
                    slo: SLO | None = None) -> dict[str, Any]:
    """Replay the workload; returns the full report (summary, per tier/tenant, per request)."""
    root = api_root(opts.base_url)
    path = "/v1/chat/completions" if opts.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=opts.max_concurrency or 10_000,
                          max_keepalive_connections=opts.max_concurrency or 10_000)
    timeout = httpx.Timeout(opts.timeout_s, connect=30.0)
    schedule = send_schedule(workload, opts)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = opts.model or await discover_model(client, root)
        gate = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
        bar = _progress(len(workload.requests)) if opts.progress else None
        t0 = time.perf_counter()

        async def one(req: WorkloadRequest, due: float) -> RequestResult:
            delay = t0 + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            res = RequestResult(req.id, req.prompt_len, req.max_tokens, req.priority, req.tenant,
                                scheduled_s=due)
            if gate is None:
                await stream_one(client, root + path, request_body(req, opts, model), res, t0)
            else:
                async with gate:
                    await stream_one(client, root + path, request_body(req, opts, model), res, t0)
            if bar is not None:
                bar.update(1)
            return res

        results = await asyncio.gather(*(one(r, d) for r, d in zip(workload.requests, schedule)))
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    report = full_report(list(results), duration, slo)
    report["meta"] = {"kind": "serve", "base_url": opts.base_url, "endpoint": opts.endpoint,
                      "model": model, "workload": workload.name, "rate": _json_rate(opts.rate),
                      "burstiness": opts.burstiness, "max_concurrency": opts.max_concurrency}
    return report


def _json_rate(rate: float | None) -> float | str | None:
    return "inf" if rate is not None and math.isinf(rate) else rate


def _progress(total: int) -> Any:
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
