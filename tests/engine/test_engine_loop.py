"""The engine loop with a toy model: stop strings, aborts, listeners, the async front."""

from __future__ import annotations

import asyncio
import dataclasses

from everystop.sampling_params import SamplingParams
from tests.core.toy_executor import reference_output

from .toy_engine import CharTokenizer, make_toy_engine


def _text(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_outputs_stream_as_deltas_that_add_up() -> None:
    eng = make_toy_engine()
    req = eng.add_request("hello", SamplingParams(max_tokens=12, ignore_eos=True))
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out.new_text)
            final = out
    expected = reference_output(req.prompt_token_ids, 12)
    assert final is not None and final.finished and final.finish_reason == "length"
    assert final.token_ids == expected
    assert "".join(deltas) == final.text == _text(expected)


def test_stop_string_spanning_tokens_ends_request_and_is_not_returned() -> None:
    eng = make_toy_engine()
    prompt = "abc"
    full = _text(reference_output([ord(c) for c in prompt], 30))
    stop = full[10:13]  # three tokens long, so it spans several steps
    if stop in full[:10]:
        stop = full[10:14]
    eng.add_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out.new_text)
            final = out
    assert final.finish_reason == "stop"
    assert final.text == full[:full.index(stop)]
    assert "".join(deltas) == final.text  # held-back text never leaked the stop string
    assert eng.kv.pool.num_used_blocks == 0


def test_abort_yields_final_output_and_frees_blocks() -> None:
    eng = make_toy_engine()
    a = eng.add_request("aaaa", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("bbbb", SamplingParams(max_tokens=5, ignore_eos=True))
    eng.step()
    eng.abort_request(a.request_id)
    outs = eng.step()
    aborted = [o for o in outs if o.request_id == a.request_id]
    assert aborted and aborted[0].finish_reason == "abort"
    assert a.request_id not in eng.kv.req_blocks


def test_iteration_listener_sees_every_step() -> None:
    eng = make_toy_engine()
    records = []
    eng.iteration_listeners.append(lambda rec, sched: records.append(rec))
    eng.add_request("xyz", SamplingParams(max_tokens=4, ignore_eos=True))
    eng.run_until_done()
    assert len(records) == eng.num_steps == 4
    assert records[0].num_prefill_tokens == 3 and records[1].num_decode_tokens == 1


def test_async_engine_streams_and_aborts_on_early_exit() -> None:
    from everystop.engine.async_engine import AsyncEngine

    eng = make_toy_engine()
    front = AsyncEngine(eng)

    async def consume(prompt: str, n: int, stop_after: int | None = None) -> list[int]:
        got: list[int] = []
        async for out in front.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
            got.extend(out.new_token_ids)
            if stop_after is not None and len(got) >= stop_after:
                break
        return got

    async def main() -> tuple[list[list[int]], list[int]]:
        full = await asyncio.gather(*(consume(f"p{i}", 20) for i in range(5)))
        partial = await consume("quit early", 200, stop_after=3)
        return full, partial

    try:
        full, partial = asyncio.run(main())
        for i, toks in enumerate(full):
            assert toks == reference_output([ord(c) for c in f"p{i}"], 20)
        assert len(partial) >= 3
        import time
        deadline = time.monotonic() + 10  # a hang guard: the abort lands within a step or two
        while eng.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not eng.has_unfinished_requests()
        assert eng.kv.pool.num_used_blocks == 0
    finally:
        front.shutdown()


def test_async_engine_wakes_each_event_loop_once_per_step() -> None:
    """A step's outputs for every stream of one event loop go over in one wake-up (not one per
    stream), and each stream still gets exactly its own tokens in order."""
    from everystop.engine.async_engine import AsyncEngine

    eng = make_toy_engine()
    front = AsyncEngine(eng)
    wakeups = [0]

    async def consume(prompt: str) -> list[int]:
        got: list[int] = []
        async for out in front.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True)):
            got.extend(out.new_token_ids)
        return got

    async def main() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        wake = loop.call_soon_threadsafe

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            wakeups[0] += 1
            return wake(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        return await asyncio.gather(*(consume(f"s{i}") for i in range(6)))

    try:
        streams = asyncio.run(main())
    finally:
        front.shutdown()
    for i, toks in enumerate(streams):
        assert toks == reference_output([ord(c) for c in f"s{i}"], 12)
    # Six streams of 12 tokens: 72 outputs, at most one wake-up per step that produced any.
    assert 12 <= wakeups[0] <= eng.num_steps < 72


class _TwoEosTokenizer(CharTokenizer):
    """A model with a second end-of-sequence id (as chat models have <|im_end|>)."""

    eos_token_ids = frozenset({2, 7})


def test_make_request_leaves_the_callers_params_unchanged() -> None:
    eng = make_toy_engine()
    eng.tokenizer = _TwoEosTokenizer()
    params = SamplingParams(max_tokens=5, stop=["x"], stop_token_ids=[9])
    before = dataclasses.asdict(params)
    stop, stop_ids = params.stop, params.stop_token_ids
    req = eng.make_request("hi", params)
    filled = eng.make_request("hi", params, max_tokens_to_context=True)
    assert dataclasses.asdict(params) == before
    assert params.stop is stop and params.stop_token_ids is stop_ids
    # The request's own copy is resolved: the second EOS id stops it too.
    assert req.sampling_params is not params and req.sampling_params.stop_token_ids == [9, 7]
    assert req.sampling_params.stop is not params.stop
    assert filled.sampling_params.max_tokens == eng.max_model_len - 2


def test_async_engine_builds_its_engine_on_the_engine_thread() -> None:
    """All torch work on one thread (see AsyncEngine): the builder runs where the steps run,
    and a builder's error reaches the caller."""
    import threading

    import pytest

    from everystop.engine.async_engine import AsyncEngine

    built_on: list[str] = []

    def build():  # type: ignore[no-untyped-def]
        built_on.append(threading.current_thread().name)
        return make_toy_engine()

    front = AsyncEngine(build)
    try:
        assert built_on == ["everystop-engine"]

        async def one() -> list[int]:
            got: list[int] = []
            async for out in front.generate("hi", SamplingParams(max_tokens=5, ignore_eos=True)):
                got.extend(out.new_token_ids)
            return got

        assert asyncio.run(one()) == reference_output([ord(c) for c in "hi"], 5)
    finally:
        front.shutdown()

    def broken():  # type: ignore[no-untyped-def]
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(broken)
