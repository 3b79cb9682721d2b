"""Turns engine events into telemetry rows without slowing the engine.

On the engine thread the recorder only snapshots a few numbers (and appends one timestamp per
sampled token, for TPOT) and hands them to the writer's queue, never blocking; the rows are built
on the writer thread by `prepare`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from everystop.core.observed_engine import ObservedEngine
from everystop.core.outputs import IterationRecord, RequestOutput, SchedulerOutput
from everystop.core.request import Request
from everystop.stats import percentile
from everystop.telemetry.alerts import Alert, Guardrails
from everystop.telemetry.rows import AlertRow, IterationRow, Row, SequenceRow
from everystop.telemetry.store import Store
from everystop.telemetry.writer import TelemetryWriter


@dataclass(frozen=True)
class IterationEvent:
    record: IterationRecord


@dataclass(frozen=True)
class FinishEvent:
    request_id: str
    tenant: str
    priority: int
    prompt_tokens: int
    max_tokens: int
    generated_tokens: int
    cached_tokens: int
    num_computed_tokens: int
    finish_reason: str | None
    preemption_count: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    arrival_time: float
    admitted_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float]  # engine clock at the end of each step that sampled a token


def _ms(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else (end - start) * 1000.0


class TelemetryRecorder:
    """Args:
        store: where rows go (through the writer thread).
        block_size: KV block size, to report blocks spanned per sequence.
        clock: the engine's clock; rows carry wall-clock times converted from it.
        guardrails: told about every iteration and finish (optional).
        model_version: stamped on sequence rows.
        max_queue: telemetry items held before new ones are dropped.
    """

    def __init__(self, store: Store, *, block_size: int,
                 clock: Callable[[], float] = time.monotonic,
                 guardrails: Guardrails | None = None, model_version: str = "unknown",
                 max_queue: int = 10_000) -> None:
        self.block_size = block_size
        self.clock = clock
        self.guardrails = guardrails
        self.model_version = model_version[:64]
        self.wall_offset = time.time() - clock()
        self.engine: ObservedEngine | None = None
        # Engine thread only (iterations and finishes both run under the engine lock).
        self._token_times: dict[str, list[float]] = {}
        self.writer = TelemetryWriter(store, max_queue=max_queue, prepare=self.prepare)

    def attach(self, engine: ObservedEngine) -> TelemetryRecorder:
        """Listen to an engine's iterations and finishes."""
        self.engine = engine
        engine.add_listeners(self.on_iteration, self.on_finish)
        return self

    def detach(self) -> None:
        if self.engine is not None:
            self.engine.remove_listeners(self.on_iteration, self.on_finish)
            self.engine = None

    # -- engine thread: snapshot and enqueue, nothing else ----------------------------------------
    def on_iteration(self, record: IterationRecord, sched: SchedulerOutput) -> None:
        end = record.time + record.latency_s
        times = self._token_times
        # NOTE: finish listeners run before iteration listeners, so a request that ended in this
        # step is gone from `live` and its last token was timed by on_finish.
        engine = self.engine
        for e in sched.scheduled:
            if e.sample and (engine is None or engine.is_live(e.request_id)):
                times.setdefault(e.request_id, []).append(end)
        self.writer.submit(IterationEvent(record))
        if self.guardrails is not None and self.engine is not None:
            self.guardrails.on_iteration(record,
                                         self.engine.scheduler_config.max_num_batched_tokens)

    def on_finish(self, req: Request, out: RequestOutput) -> None:
        event = FinishEvent(
            req.request_id, req.tenant, req.priority, req.num_prompt_tokens,
            req.sampling_params.max_tokens, req.num_output_tokens, max(req.num_cached_tokens, 0),
            req.num_computed_tokens, out.finish_reason or req.status.finish_reason,
            req.preemption_count, req.num_preemptions_recompute, req.num_preemptions_swap,
            req.arrival_time, req.admitted_time, req.first_token_time,
            req.finished_time if req.finished_time is not None else self.clock(),
            self._token_times.pop(req.request_id, []))
        if out.finish_reason != "abort" and event.finished_time is not None:
            event.token_times.append(event.finished_time)  # the token that ended it
        self.writer.submit(event)
        if self.guardrails is not None:
            self.guardrails.on_finish(req)

    def submit_alert(self, alert: Alert) -> bool:
        return self.writer.submit(AlertRow(
            alert.time + self.wall_offset, alert.kind, alert.tier, alert.request_id,
            float(alert.value), float(alert.threshold), alert.message))

    # -- writer thread ----------------------------------------------------------------------------
    def prepare(self, batch: list[Any]) -> list[Row]:
        rows: list[Row] = []
        for item in batch:
            if isinstance(item, IterationEvent):
                rows.append(self._iteration_row(item))
            elif isinstance(item, FinishEvent):
                rows.append(self._sequence_row(item))
            else:
                rows.append(item)  # already a row (alerts)
        return rows

    def _iteration_row(self, ev: IterationEvent) -> IterationRow:
        rec = ev.record
        cost = rec.step_cost
        return IterationRow(
            recorded_at=rec.time + self.wall_offset, step=rec.step,
            num_decode_tokens=rec.num_decode_tokens, num_prefill_tokens=rec.num_prefill_tokens,
            batch_size=rec.num_seqs, free_kv_blocks=rec.num_free_blocks,
            iteration_latency_ms=rec.latency_s * 1000.0, num_running=rec.num_running,
            num_waiting=rec.num_waiting, num_preempted=rec.num_preempted,
            context_tokens=rec.context_tokens, execute_ms=rec.execute_s * 1000.0,
            predicted_step_ms=rec.predicted_s * 1000.0,
            tpot_target_ms=None if rec.tpot_target_s is None else rec.tpot_target_s * 1000.0,
            prefill_budget_tokens=rec.prefill_budget_tokens,
            step_cost_fixed_s=cost.get("fixed", 0.0),
            step_cost_prefill_token_s=cost.get("prefill_token", 0.0),
            step_cost_decode_row_s=cost.get("decode_row", 0.0),
            step_cost_context_token_s=cost.get("context_token", 0.0))

    def _sequence_row(self, ev: FinishEvent) -> SequenceRow:
        times = ev.token_times
        gaps = [(b - a) * 1000.0 for a, b in zip(times, times[1:])]
        wall = self.wall_offset
        return SequenceRow(
            seq_id=uuid.uuid4().hex, request_id=ev.request_id, tenant_id=ev.tenant[:64],
            priority_tier=ev.priority, prompt_tokens=ev.prompt_tokens,
            max_output_tokens=ev.max_tokens, generated_tokens=ev.generated_tokens,
            cached_tokens=ev.cached_tokens, num_computed_tokens=ev.num_computed_tokens,
            status="aborted" if ev.finish_reason == "abort" else "finished",
            finish_reason=ev.finish_reason, preemption_count=ev.preemption_count,
            num_preemptions_recompute=ev.num_preemptions_recompute,
            num_preemptions_swap=ev.num_preemptions_swap,
            num_kv_blocks=-(-ev.num_computed_tokens // self.block_size),
            arrival_time=ev.arrival_time + wall,
            admitted_at=None if ev.admitted_time is None else ev.admitted_time + wall,
            completed_at=None if ev.finished_time is None else ev.finished_time + wall,
            queue_wait_ms=_ms(ev.arrival_time, ev.admitted_time),
            ttft_ms=_ms(ev.arrival_time, ev.first_token_time),
            tpot_p50_ms=percentile(gaps, 50),
            e2e_ms=_ms(ev.arrival_time, ev.finished_time),
            model_version=self.model_version)
