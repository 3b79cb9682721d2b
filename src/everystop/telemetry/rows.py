"""The rows the telemetry store holds, one dataclass per table (see schema.py).

Times are Unix epoch seconds (floats) everywhere in Python; the PostgreSQL backend stores them
as TIMESTAMPTZ and converts at its boundary, SQLite stores the floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass
class SequenceRow:
    """One finished (or aborted) sequence: written once, when it ends."""

    table: ClassVar[str] = "sequences"
    time_fields: ClassVar[tuple[str, ...]] = ("arrival_time", "admitted_at", "completed_at")

    seq_id: str
    request_id: str
    tenant_id: str
    priority_tier: int
    prompt_tokens: int
    max_output_tokens: int
    generated_tokens: int
    cached_tokens: int
    num_computed_tokens: int
    status: str  # finished | aborted
    finish_reason: str | None
    preemption_count: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_kv_blocks: int  # blocks its context spanned at the end
    arrival_time: float
    admitted_at: float | None
    completed_at: float | None
    queue_wait_ms: float | None
    ttft_ms: float | None
    tpot_p50_ms: float | None
    e2e_ms: float | None
    model_version: str


@dataclass
class IterationRow:
    """One scheduler iteration (engine step)."""

    table: ClassVar[str] = "scheduler_iterations"
    time_fields: ClassVar[tuple[str, ...]] = ("recorded_at",)

    recorded_at: float
    step: int
    num_decode_tokens: int
    num_prefill_tokens: int
    batch_size: int
    free_kv_blocks: int
    iteration_latency_ms: float
    num_running: int
    num_waiting: int
    num_preempted: int
    context_tokens: int
    # The step budget (core/step_budget.py): the forward pass as the executor timed it (what
    # the step-cost fit observes), the fit's prediction for this step's shape when it was
    # scheduled, the TPOT target the step was held to (None: none, e.g. no decodes), the
    # prefill tokens that target left after the decodes, and the fitted cost terms after this
    # step (seconds per unit: per step, prefill token, decode row, context token read).
    execute_ms: float = 0.0
    predicted_step_ms: float = 0.0
    tpot_target_ms: float | None = None
    prefill_budget_tokens: int = 0
    step_cost_fixed_s: float = 0.0
    step_cost_prefill_token_s: float = 0.0
    step_cost_decode_row_s: float = 0.0
    step_cost_context_token_s: float = 0.0


@dataclass
class ConfigRow:
    """One version of the hot-reloadable scheduler configuration."""

    table: ClassVar[str] = "scheduler_config"
    time_fields: ClassVar[tuple[str, ...]] = ("updated_at",)

    version: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunk_size: int
    gpu_memory_utilization: float
    kv_watermark_pct: float
    max_queued_per_tenant: int
    max_queued_per_tier: str  # "t0,t1,t2"
    source: str  # startup | admin
    config_json: str  # the whole SchedulerConfig, for exact replay
    updated_at: float


@dataclass
class AlertRow:
    """A guardrail firing: prefill_ceiling, starvation or kv_leak."""

    table: ClassVar[str] = "alerts"
    time_fields: ClassVar[tuple[str, ...]] = ("raised_at",)

    raised_at: float
    kind: str
    tier: int | None
    request_id: str | None
    value: float
    threshold: float
    message: str


Row = SequenceRow | IterationRow | ConfigRow | AlertRow
ROW_TYPES: tuple[type, ...] = (SequenceRow, IterationRow, ConfigRow, AlertRow)
