"""CPU-heavy request preparation (JSON parsing, chat templating, tokenizing) off the event loop.

One request's 8 MB prompt takes seconds to tokenize; on the event loop that would stall
`/health` and every other client's stream for as long. Small inputs run inline: a thread hop
costs more than tokenizing a short prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from everystop.core.request import Request
from everystop.engine.async_engine import AsyncEngine
from everystop.sampling_params import SamplingParams

T = TypeVar("T")

# Characters (or token ids, or bytes) below which the work is done inline.
INLINE_SIZE = 4096


async def off_loop(fn: Callable[..., T], *args: Any, size: int, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, on a worker thread when `size` says the input is large."""
    if size <= INLINE_SIZE:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


async def make_request(engine: AsyncEngine, prompt: str | list[int], params: SamplingParams,
                       **kwargs: Any) -> Request:
    """The engine's make_request (tokenizing) off the loop. ValueError for an empty prompt:
    nothing to condition on is the client's mistake, not a context-length problem."""
    req = await off_loop(engine.make_request, prompt, params, size=len(prompt), **kwargs)
    if not req.prompt_token_ids:
        raise ValueError("prompt is empty: it has no tokens")
    return req
