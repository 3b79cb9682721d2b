"""CPU-heavy request preparation (JSON parsing, chat templating, tokenizing) off the event loop.

One request's 8 MB prompt takes seconds to tokenize; on the event loop that would stall
`/health` and every other client's stream for as long. Small inputs run inline: a thread hop
costs more than tokenizing a short prompt.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from everystop.core.request import Request
from everystop.engine.async_engine import AsyncEngine
from everystop.sampling_params import SamplingParams
from everystop.server.errors import bad_request

T = TypeVar("T")

# Characters (or token ids, or bytes) below which the work is done inline.
INLINE_SIZE = 4096
# Token ids rendered per call by json_with_ids.
IDS_PER_SLICE = 1 << 15


async def off_loop(fn: Callable[..., T], *args: Any, size: int, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, on a worker thread when `size` says the input is large."""
    if size <= INLINE_SIZE:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


async def make_request(engine: AsyncEngine, prompt: str | list[int], params: SamplingParams,
                       **kwargs: Any) -> Request:
    """The engine's make_request (tokenizing) off the loop. ValueError for an empty prompt:
    nothing to condition on is the client's mistake, not a context-length problem."""
    if isinstance(prompt, str):
        check_text_fits(engine, len(prompt))
    req = await off_loop(engine.make_request, prompt, params, size=len(prompt), **kwargs)
    if not req.prompt_token_ids:
        raise ValueError("prompt is empty: it has no tokens")
    return req


def check_text_fits(engine: AsyncEngine, num_chars: int) -> None:
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
