"""Engine events become sequence and iteration rows that add up to what the engine did, and a
stuck store never slows the engine: the queue overflows, items are dropped and counted."""

from __future__ import annotations

import threading
from typing import Any

from everystop.core.step_cost import StepShape
from everystop.telemetry.recorder import TelemetryRecorder
from everystop.telemetry.rows import IterationRow, SequenceRow
from everystop.telemetry.store import Store
from tests.core.helpers import FakeClock
from tests.core.toy_executor import ToyExecutor, reference_output

from .helpers import make_engine, params, run


def test_rows_match_what_the_engine_did(store: Store) -> None:
    clock = FakeClock()
    eng = make_engine(clock)
    rec = TelemetryRecorder(store, block_size=4, clock=clock, model_version="toy").attach(eng)
    specs = [("a" * 30, 5, "acme", 0), ("b" * 12, 9, "acme", 1), ("c" * 40, 3, "beta", 2),
             ("d" * 7, 12, "beta", 1)]
    reqs = [eng.add_request(p, params(n), tenant=t, priority=tier) for p, n, t, tier in specs]
    clock.now += 0.5  # they queue for a while before the first step
    run(eng, clock, dt=0.01)
    assert rec.writer.flush()
    seqs = {r.request_id: r for r in store.fetch(SequenceRow)}
    iters = store.fetch(IterationRow)
    assert [i.step for i in iters] == list(range(1, eng.num_steps + 1))
    assert sum(i.num_prefill_tokens for i in iters) == sum(len(p) for p, *_ in specs)
    # A request's first token ends its prefill; every later token is one decode.
    assert sum(i.num_decode_tokens for i in iters) == sum(n - 1 for _, n, *_ in specs)
    for req, (prompt, n, tenant, tier) in zip(reqs, specs):
        row = seqs[req.request_id]
        assert (row.tenant_id, row.priority_tier, row.prompt_tokens) == (tenant, tier, len(prompt))
        assert (row.generated_tokens, row.status, row.finish_reason) == (n, "finished", "length")
        assert row.model_version == "toy" and row.preemption_count == 0
        assert row.queue_wait_ms is not None and row.queue_wait_ms >= 500.0 - 1e-6
        assert row.ttft_ms is not None and row.ttft_ms >= row.queue_wait_ms
        assert abs(row.completed_at - row.arrival_time - row.e2e_ms / 1000.0) < 1e-5
        # The toy engine decodes each running request every step: 10 ms per output token.
        assert abs(row.tpot_p50_ms - 10.0) < 1e-6
        assert row.num_kv_blocks == -(-(len(prompt) + n - 1) // 4)
    rec.writer.close()


def _known_cost(shape: StepShape) -> float:
    return (0.005 + 1e-4 * shape.num_prefill_tokens + 5e-4 * shape.num_decode_rows
            + 1e-6 * shape.context_tokens)


def test_iteration_rows_carry_the_step_budget(store: Store) -> None:
    """Each iteration row says what the step-cost fit predicted and what the pass measured, the
    target and prefill budget the step was held to, and the fitted terms after it."""
    clock = FakeClock()
    eng = make_engine(clock, executor=ToyExecutor(256, 4, cost_fn=_known_cost),
                      tpot_target_ms=20.0)
    rec = TelemetryRecorder(store, block_size=4, clock=clock).attach(eng)
    for i in range(12):  # prompts keep arriving while others decode
        eng.add_request(chr(97 + i) * (20 + 5 * i), params(8))
        for _ in range(3):
            eng.step()
            clock.now += 0.01
    run(eng, clock)
    assert rec.writer.flush()
    iters = store.fetch(IterationRow)
    assert len(iters) == eng.num_steps
    for row in iters:
        shape = StepShape(row.num_prefill_tokens, row.num_decode_tokens, row.context_tokens)
        assert abs(row.execute_ms - 1000.0 * _known_cost(shape)) < 1e-6
        assert row.predicted_step_ms > 0 and 0 <= row.prefill_budget_tokens <= 64
        # A step with decodes is held to the target; one with none has no target.
        assert row.tpot_target_ms == (20.0 if row.num_decode_tokens else None)
    last = iters[-1]
    fitted = eng.scheduler.step_cost.coefficients
    assert (last.step_cost_fixed_s, last.step_cost_prefill_token_s, last.step_cost_decode_row_s,
            last.step_cost_context_token_s) == fitted.as_tuple()
    # By the end the fit predicts the known cost closely.
    late = iters[len(iters) // 2:]
    assert max(abs(r.predicted_step_ms - r.execute_ms) / r.execute_ms for r in late) < 0.05
    rec.writer.close()


def test_aborted_and_prefix_cached_requests_are_recorded(store: Store) -> None:
    clock = FakeClock()
    eng = make_engine(clock)
    rec = TelemetryRecorder(store, block_size=4, clock=clock).attach(eng)
    shared = "system prompt shared by both! "  # 30 tokens: 7 full blocks
    first = eng.add_request(shared + "one", params(4))
    run(eng, clock)
    second = eng.add_request(shared + "two", params(4))
    doomed = eng.add_request("never finishes", params(500))
    eng.step()
    eng.abort_request(doomed.request_id)
    run(eng, clock)
    assert rec.writer.flush()
    seqs = {r.request_id: r for r in store.fetch(SequenceRow)}
    assert seqs[first.request_id].cached_tokens == 0
    assert seqs[second.request_id].cached_tokens == 28
    assert seqs[doomed.request_id].status == "aborted"
    assert seqs[doomed.request_id].finish_reason == "abort"
    rec.writer.close()


class StuckStore:
    """A store whose writes hang until released: a database that stopped answering."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.entered = threading.Event()

    def insert(self, rows: list[Any]) -> None:
        self.entered.set()
        self.release.wait()
        self.inner.insert(rows)


def test_flooded_queue_drops_and_counts_and_never_stalls_the_engine(store: Store) -> None:
    stuck = StuckStore(store)
    eng = make_engine(max_num_seqs=4)
    rec = TelemetryRecorder(stuck, block_size=4, max_queue=16).attach(eng)  # type: ignore[arg-type]
    reqs = [eng.add_request(f"prompt {i}", params(40)) for i in range(12)]
    got: dict[str, list[int]] = {}
    engine = threading.Thread(target=lambda: got.update(run(eng)))
    try:
        engine.start()
        engine.join(timeout=120)  # a liveness bound, not a timing: the store never answers
        assert not engine.is_alive(), "the engine waited on the telemetry store"
        assert stuck.entered.is_set() and not stuck.release.is_set()
        for req in reqs:  # every request finished correctly while the store was stuck
            assert got[req.request_id] == reference_output(req.prompt_token_ids, 40)
        w = rec.writer
        events = eng.num_steps + len(reqs)  # one per iteration, one per finish
        assert sum(w.submitted.values()) + sum(w.dropped.values()) == events
        assert w.dropped["IterationEvent"] > 0
        assert sum(w.submitted.values()) <= 16 + 1 + w.batch_size  # queue + one batch in hand
    finally:
        stuck.release.set()
        engine.join(timeout=30)
    assert rec.writer.flush()
    # Whatever was accepted reaches the store; the drops are the only loss.
    assert store.count(IterationRow) == rec.writer.submitted["IterationEvent"]
    assert store.count(SequenceRow) == rec.writer.submitted["FinishEvent"]
    assert rec._token_times == {}  # per-token timing of dropped finishes is not kept
    rec.writer.close()
