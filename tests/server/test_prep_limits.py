"""Request preparation's limits through the app: structured-output specs and tool schemas over
a size limit, token-id lists over max_token_ids (400s naming the limit), and the preparation
pool's own bounds (503 prep_timeout_s, 503 prep_queue_full) and the grammar compiler's (400
grammar_compile_timeout_s, 503 grammar_compiler_busy)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from everystop.config import StructuredOutputConfig
from everystop.engine.async_engine import AsyncEngine
from everystop.server.app import build_app
from everystop.server.errors import APIError
from everystop.server.limits import RequestLimits
from everystop.server.offload import INLINE_SIZE, PrepLimits, PrepPool
from tests.engine.test_grammar_compiler import GatedCompiler
from tests.engine.toy_engine import make_toy_engine
from tests.server.fakes import ChatCharTokenizer


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    engine = make_toy_engine()
    engine.tokenizer = ChatCharTokenizer()
    front = AsyncEngine(engine)
    try:
        with TestClient(build_app(front, "toy", limits=RequestLimits(max_token_ids=100))) as c:
            yield c
    finally:
        front.shutdown()


def _error(r: object) -> dict:
    assert r.status_code == 400, r.text  # type: ignore[attr-defined]
    return r.json()["error"]  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize("fields,param,limit", [
    ({"guided_choice": [f"c{i}" for i in range(5000)]}, "guided_choice", "max_choices"),
    ({"guided_regex": "a" * 20000}, "guided_regex", "max_regex_chars"),
    ({"guided_json": '{"type": "array", "items": ' * 100 + "{}" + "}" * 100}, "guided_json",
     "max_schema_depth"),
    ({"guided_json": {"enum": list(range(5000))}}, "guided_json", "max_enum_values"),
])
def test_a_spec_over_a_limit_is_a_400_naming_it(client: TestClient, fields: dict, param: str,
                                                limit: str) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **fields})
    error = _error(r)
    assert (error["code"], error["param"]) == (limit, param) and limit in error["message"]


def test_tools_over_a_schema_limit_are_a_400_whatever_the_tool_choice(
        client: TestClient) -> None:
    props = {f"p{i}": {"type": "string"} for i in range(3000)}
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": props}}}
    for choice in ("auto", "required"):
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [tool],
            "tool_choice": choice})
        error = _error(r)
        assert (error["code"], error["param"]) == ("max_schema_properties", "tools"), error


def test_token_ids_over_max_token_ids_are_a_400_before_validation(client: TestClient) -> None:
    for path, body in (("/detokenize", {"tokens": [1] * 101}),
                       ("/v1/completions", {"prompt": [[1] * 60, [1] * 60], "max_tokens": 2})):
        error = _error(client.post(path, json=body))
        assert error["code"] == "max_token_ids" and "max_token_ids (100)" in error["message"]
    assert client.post("/detokenize", json={"tokens": [65] * 100}).json() == {"prompt": "A" * 100}


def test_a_large_detokenize_is_decoded_on_a_worker(client: TestClient) -> None:
    """Over the inline size, /detokenize still answers (its decode on a prep thread)."""
    engine = make_toy_engine()
    engine.tokenizer = ChatCharTokenizer()
    front = AsyncEngine(engine)
    try:
        with TestClient(build_app(front, "toy")) as big:
            r = big.post("/detokenize", json={"tokens": [66] * (INLINE_SIZE + 1)})
            assert r.json() == {"prompt": "B" * (INLINE_SIZE + 1)}
            bad = big.post("/detokenize", json={"tokens": [10**6] * (INLINE_SIZE + 1)})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    finally:
        front.shutdown()


def test_the_pool_runs_small_jobs_inline_and_large_ones_on_a_worker() -> None:
    async def main() -> tuple[str, str]:
        pool = PrepPool()
        try:
            small = await pool.run(lambda: threading.current_thread().name, size=1)
            large = await pool.run(lambda: threading.current_thread().name,
                                   size=INLINE_SIZE + 1)
            return small, large
        finally:
            pool.shutdown()

    small, large = asyncio.run(main())
    assert small == threading.current_thread().name
    assert large.startswith("everystop-prep")


def test_a_job_past_its_time_limit_is_a_503_and_stays_counted_until_it_ends() -> None:
    release = threading.Event()

    async def main() -> None:
        pool = PrepPool(PrepLimits(workers=1, max_pending=1, timeout_s=0.05))
        try:
            with pytest.raises(APIError) as late:
                await pool.run_always(release.wait, 10)
            assert (late.value.status, late.value.code) == (503, "prep_timeout_s")
            with pytest.raises(APIError) as full:  # the late job still holds the one slot
                await pool.run_always(json.dumps, 1)
            assert (full.value.status, full.value.code) == (503, "prep_queue_full")
            assert full.value.headers["Retry-After"] == "1"
            release.set()
            deadline = time.monotonic() + 10  # a hang guard: the worker ends it at once
            while pool.num_pending and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert await pool.run_always(json.dumps, 1) == "1"
        finally:
            release.set()
            pool.shutdown()

    asyncio.run(main())


def test_a_slow_compile_is_a_400_naming_the_time_limit_and_a_full_compiler_a_503() -> None:
    engine = make_toy_engine()
    compiler = GatedCompiler(StructuredOutputConfig(grammar_compile_timeout_s=0.05,
                                                    max_concurrent_compiles=1))
    engine.structured.compiler = compiler
    front = AsyncEngine(engine)
    try:
        with TestClient(build_app(front, "toy")) as c:
            body = {"prompt": "hi", "max_tokens": 2}
            slow = c.post("/v1/completions", json={**body, "guided_regex": "slow"})
            error = _error(slow)
            assert (error["code"], error["param"]) == ("grammar_compile_timeout_s",
                                                       "guided_regex")
            busy = c.post("/v1/completions", json={**body, "guided_regex": "other"})
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
            assert busy.json()["error"]["code"] == "grammar_compiler_busy"
            assert c.get("/health").status_code == 200
    finally:
        compiler.gate.set()
        front.shutdown()
