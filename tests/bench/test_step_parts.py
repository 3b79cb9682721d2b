"""The serving-path step breakdown: exclusive part times, and a real single stream through
AsyncEngine with every part accounted for."""

from __future__ import annotations

import itertools

from everystop.bench.step_parts import (
    ENGINE_PARTS,
    PartClock,
    engine_builder,
    measure,
    summarize,
)


def test_a_part_excludes_the_parts_inside_it() -> None:
    ticks = itertools.count()
    clock = PartClock(now=lambda: float(next(ticks)))
    inner = clock.wrap("inner", lambda: next(ticks))  # one tick inside, two clock reads
    outer = clock.wrap("outer", lambda: (next(ticks), inner(), next(ticks)))
    outer()
    # outer: read at 0, ticks 1, inner reads 2 and 4 (tick 3 inside), ticks 5, read at 6.
    assert clock.take() == {"outer": 4.0, "inner": 2.0}
    assert clock.take() == {}


def test_summarize_drops_the_prefill_and_warm_up_and_splits_kernels_from_the_rest() -> None:
    def period(kernel: float, other: float) -> dict[str, float]:
        return {"forward_kernels": kernel, "scheduler": other, "period": kernel + other}

    periods = [period(1.0, 1.0)] + [period(0.004, 0.001)] * 5
    seen = [{"arrived": 0.005 * i, "sse": 1e-5, "handoff": 2e-5} for i in range(6)]
    out = summarize(periods, seen, warmup=1)
    assert out["decode_steps"] == 4
    assert out["kernels_us"] == 4000.0 and out["everything_else_us"] == 1000.0
    assert out["kernels_share"] == 0.8
    assert out["tpot_us_median"] == 5000.0
    assert out["event_loop_us"] == {"handoff": 20.0, "sse": 10.0}


def test_a_single_stream_served_through_the_async_engine_accounts_for_every_part() -> None:
    from everystop.executor import model_runner as mr
    from everystop.tokenizer import IncrementalDetokenizer

    wrapped = (mr.build_inputs, IncrementalDetokenizer.push)
    out = measure(engine_builder({"max_num_seqs": 4}), list(range(100, 140)), decode_steps=4,
                  warmup=1)
    parts = out["engine_thread_us"]
    assert out["decode_steps"] == 4
    assert set(parts) == set(ENGINE_PARTS)
    for name in ("scheduler", "input_build", "forward_kernels", "lm_head", "sampler",
                 "output_processing", "detokenize", "deliver"):
        assert parts[name] > 0, name
    assert out["period_us_median"] > out["kernels_us"] > 0
    assert out["event_loop_us"]["sse"] > 0
    # What the measurement wrapped process-wide is put back.
    assert (mr.build_inputs, IncrementalDetokenizer.push) == wrapped
