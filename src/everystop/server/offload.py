"""CPU-heavy request preparation off the event loop, in a bounded pool of worker threads.

What runs here: JSON parsing and validation of large bodies, chat templating (tools included),
tokenizing, grammar compiles (through the engine's make_request), detokenizing and rendering
long id lists. On the event loop any of these stalls `/health` and every other client's stream
for as long as it runs (a 10 MB prompt: seconds). Threads suffice: the tokenizers and xgrammar
release the GIL for most of their work, and what holds it is kept short (`json_with_ids`).

Small inputs run inline: a thread hop costs more than tokenizing a short prompt. Each job has a
time limit, and the pool a bound on jobs waiting or running; past either the client gets a 503
naming the limit (a worker past its time limit finishes in the background, still counted).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from everystop.core.request import Request
from everystop.engine.client import EngineClient
from everystop.sampling_params import SamplingParams
from everystop.server.errors import APIError, bad_request

T = TypeVar("T")

# Characters (or token ids, or bytes) below which the work is done inline.
INLINE_SIZE = 4096
# Token ids rendered per call by json_with_ids.
IDS_PER_SLICE = 1 << 15


@dataclass(frozen=True)
class PrepLimits:
    workers: int = 4  # threads preparing requests at once
    max_pending: int = 64  # jobs waiting or running; more are refused (503 prep_queue_full)
    timeout_s: float = 60.0  # one job, waiting included (503 prep_timeout_s)

    def __post_init__(self) -> None:
        for name in ("workers", "max_pending", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"prep {name} must be > 0")


class PrepPool:
    """The server's request-preparation workers (one per app)."""

    def __init__(self, limits: PrepLimits | None = None) -> None:
        self.limits = limits or PrepLimits()
        self._pool: ThreadPoolExecutor | None = None  # started at first use
        self.num_pending = 0  # read and written on the event loop only
        self.num_timeouts = 0

    async def run(self, fn: Callable[..., T], *args: Any, size: int, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`: inline when `size` says the input is small, else on a worker."""
        if size <= INLINE_SIZE:
            return fn(*args, **kwargs)
        return await self.run_always(fn, *args, **kwargs)

    async def run_always(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a worker, whatever its size (a grammar compile's time does
        not follow its spec's length)."""
        limits = self.limits
        if self.num_pending >= limits.max_pending:
            raise APIError(503, f"{self.num_pending} requests are being prepared, the most "
                                f"max_pending ({limits.max_pending}) allows; retry later",
                           code="prep_queue_full", headers={"Retry-After": "1"})
        if self._pool is None:
            self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="everystop-prep")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        self.num_pending += 1
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.shield(future), limits.timeout_s)
        except TimeoutError:
            self.num_timeouts += 1
            raise APIError(503, f"preparing the request took longer than prep_timeout_s "
                                f"({limits.timeout_s:g} s)", code="prep_timeout_s") from None

    def _done(self, future: asyncio.Future[Any]) -> None:
        self.num_pending -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a job given up on raises nothing at collection

    def shutdown(self) -> None:
        """Stop the workers; an app served again (a test client's second lifespan) starts new
        ones at its next request."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def check_text_fits(engine: EngineClient, num_chars: int) -> None:
    """A 400 (context_length_exceeded), without tokenizing, for a text too long to fit the
    context window whatever its tokens (a 10 MB prompt costs seconds of tokenizing only to be
    refused)."""
    max_chars = getattr(engine.tokenizer, "max_token_chars", None)
    if not max_chars:
        return
    at_least = -(-num_chars // max_chars)
    if at_least > engine.max_model_len:
        raise bad_request(f"the prompt's {num_chars} characters are at least {at_least} tokens, "
                          f"over max_model_len ({engine.max_model_len})", "prompt",
                          code="context_length_exceeded")


def check_ids_fit(engine: EngineClient, num_ids: int) -> None:
    """A 400 (context_length_exceeded) for a token-id prompt longer than the context window,
    before any of its ids is looked at."""
    if num_ids > engine.max_model_len:
        raise bad_request(f"the prompt's {num_ids} tokens exceed max_model_len "
                          f"({engine.max_model_len})", "prompt", code="context_length_exceeded")


def make_request(engine: EngineClient, prompt: str | list[int], params: SamplingParams,
                 **kwargs: Any) -> Request:
    """The engine's make_request (tokenizing, compiling a grammar), after the cheap length
    checks. ValueError for an empty prompt: nothing to condition on is the client's mistake,
    not a context-length problem. Blocking: run it on a PrepPool worker."""
    if isinstance(prompt, str):
        check_text_fits(engine, len(prompt))
    else:
        check_ids_fit(engine, len(prompt))
    req = engine.make_request(prompt, params, **kwargs)
    if not req.prompt_token_ids:
        raise ValueError("prompt is empty: it has no tokens")
    return req


def json_with_ids(ids: list[int], fields: dict[str, Any]) -> bytes:
    """`{"tokens": ids, **fields}` as JSON, the ids rendered a slice at a time. NOTE: one
    json.dumps of a 10 MB prompt's 2M ids is a single C call that holds the GIL for 100+ ms,
    stalling the event loop even from a worker thread; between slices other threads run."""
    parts = [b'{"tokens":[']
    for start in range(0, len(ids), IDS_PER_SLICE):
        if start:
            parts.append(b",")
        parts.append(",".join(map(str, ids[start:start + IDS_PER_SLICE])).encode())
    parts.append(b"]")
    parts.extend(f",{json.dumps(k)}:{json.dumps(v)}".encode() for k, v in fields.items())
    parts.append(b"}")
    return b"".join(parts)
