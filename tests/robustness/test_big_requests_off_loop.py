"""A huge prompt is tokenized off the event loop: while its encode() is still running, /health
and other clients are answered (on the loop, a 10 MB prompt would freeze every client for
seconds).

No timing: the tokenizer blocks inside encode() until the test has had /health answered, so
an encode() on the loop would hang /health outright.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from everystop.engine.async_engine import AsyncEngine
from everystop.server.app import build_app
from tests.engine.toy_engine import make_toy_engine
from tests.server.fakes import ChatCharTokenizer

LONG = 200_000  # characters: far above the inline threshold, under the body limit


class BlockingTokenizer(ChatCharTokenizer):
    """encode() of a long text signals `entered`, then waits for `release`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) >= LONG:
            self.entered.set()
            if not self.release.wait(30):
                raise TimeoutError("never released")
        return super().encode(text, add_special_tokens)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"prompt": "x" * LONG}),
    ("/v1/completions", {"prompt": "x" * LONG, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * LONG}],
                              "max_tokens": 1}),
])
def test_health_answers_while_a_huge_prompt_is_tokenized(path: str, body: dict) -> None:
    tok = BlockingTokenizer()
    engine = make_toy_engine(max_model_len=512)
    engine.tokenizer = tok
    front = AsyncEngine(engine)  # type: ignore[arg-type]
    try:
        with TestClient(build_app(front, "toy")) as client:
            big, big_out = in_thread(lambda: client.post(path, json=body))
            assert tok.entered.wait(30), "the big request never reached encode()"
            health, health_out = in_thread(lambda: client.get("/health"))
            health.join(10)
            answered = not health.is_alive()
            tok.release.set()
            big.join(30)
            health.join(10)
            assert answered, "/health waited for the tokenizer: encode() ran on the event loop"
            assert health_out[0].status_code == 200
            r: httpx.Response = big_out[0]
            # The toy model's context is 512 tokens: a 400 for length, after tokenizing.
            assert r.status_code == (200 if path == "/tokenize" else 400), r.text
    finally:
        tok.release.set()
        front.shutdown()
