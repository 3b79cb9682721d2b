"""A consumer that stops reading its stream: its backlog and blocks are bounded in time, and
the others are not held up."""

from __future__ import annotations

import asyncio
import time

from everystop.engine.async_engine import AsyncEngine
from everystop.sampling_params import SamplingParams
from tests.core.toy_executor import reference_output
from tests.engine.toy_engine import make_toy_engine
from tests.server.fakes import SlowToyExecutor


def test_a_stalled_reader_is_aborted_its_backlog_dropped_and_others_finish() -> None:
    eng = make_toy_engine(num_blocks=512)
    eng.executor = SlowToyExecutor(512, 4, step_delay_s=0.002)
    front = AsyncEngine(eng, watchdog_interval_s=0.05, slow_reader_timeout_s=0.3)

    async def main() -> None:
        params = SamplingParams(max_tokens=1500, ignore_eos=True)
        stalled = front.make_request("never read again", params)
        other = front.make_request("read promptly", SamplingParams(max_tokens=200,
                                                                   ignore_eos=True))
        front.submit(stalled)
        front.submit(other)
        reader = front.stream(stalled.request_id)
        first = await reader.__anext__()  # one output, then the reader stops reading
        assert not first.finished
        got = [out async for out in front.stream(other.request_id)]
        assert got[-1].token_ids == reference_output(other.prompt_token_ids, 200)
        deadline = time.monotonic() + 10
        while front.num_slow_reader_aborts == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert front.num_slow_reader_aborts == 1
        # Counted just before the abort is made (on the engine thread): wait on its effect.
        while (front.stats().num_used_blocks or front.is_live(stalled.request_id)) and \
                time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert front.stats().num_used_blocks == 0 and not front.is_live(stalled.request_id)
        # The reader comes back: what was left is at most the final output, an abort.
        rest = [out async for out in reader]
        assert len(rest) <= 2 and rest[-1].finish_reason == "abort"
        assert len(rest[-1].token_ids) < 1500

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        front.shutdown()
