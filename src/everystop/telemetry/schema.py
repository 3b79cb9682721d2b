"""The telemetry schema and its migrations, for SQLite and PostgreSQL from one source.

Version 1 is the design's data model (sequences, scheduler_iterations, scheduler_config;
kv_block_table is left out: block tables change every step and live only in memory). Version 2
adds what the guardrails and `everystop report` need; version 3 the step budget of each
iteration (core/step_cost.py, core/step_budget.py). Append migrations, never edit a shipped
one: a database records the versions it has applied in `schema_version`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Dialect = Literal["sqlite", "postgres"]

# Column types per dialect. SQLite keeps times as epoch-second REALs; PostgreSQL as TIMESTAMPTZ.
_TYPES: dict[str, dict[str, str]] = {
    "sqlite": {"id": "INTEGER PRIMARY KEY AUTOINCREMENT", "ts": "REAL", "float": "REAL",
               "now": "((julianday('now') - 2440587.5) * 86400.0)"},
    "postgres": {"id": "BIGSERIAL PRIMARY KEY", "ts": "TIMESTAMPTZ", "float": "DOUBLE PRECISION",
                 "now": "NOW()"},
}


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]

    def sql(self, dialect: Dialect) -> list[str]:
        return [s.format(**_TYPES[dialect]) for s in self.statements]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "the design's data model", (
        """CREATE TABLE sequences (
            seq_id              VARCHAR(64) PRIMARY KEY,
            request_id          TEXT NOT NULL,
            tenant_id           VARCHAR(64) NOT NULL,
            priority_tier       SMALLINT NOT NULL DEFAULT 2,
            prompt_tokens       INTEGER NOT NULL,
            max_output_tokens   INTEGER NOT NULL DEFAULT 1024,
            generated_tokens    INTEGER NOT NULL DEFAULT 0,
            num_computed_tokens INTEGER NOT NULL DEFAULT 0,
            status              VARCHAR(16) NOT NULL DEFAULT 'waiting',
            preemption_count    SMALLINT NOT NULL DEFAULT 0,
            num_kv_blocks       INTEGER NOT NULL DEFAULT 0,
            arrival_time        {ts} NOT NULL DEFAULT {now},
            admitted_at         {ts},
            completed_at        {ts},
            ttft_ms             {float},
            tpot_p50_ms         {float},
            model_version       VARCHAR(64) NOT NULL)""",
        """CREATE TABLE scheduler_iterations (
            iteration_id         {id},
            recorded_at          {ts} NOT NULL DEFAULT {now},
            num_decode_tokens    INTEGER NOT NULL,
            num_prefill_tokens   INTEGER NOT NULL,
            batch_size           INTEGER NOT NULL,
            free_kv_blocks       INTEGER NOT NULL,
            iteration_latency_ms {float} NOT NULL)""",
        "CREATE INDEX ix_iterations_recorded_at ON scheduler_iterations (recorded_at)",
        """CREATE TABLE scheduler_config (
            config_id              {id},
            max_num_seqs           INTEGER NOT NULL DEFAULT 128,
            max_num_batched_tokens INTEGER NOT NULL DEFAULT 2048,
            chunk_size             INTEGER NOT NULL DEFAULT 512,
            gpu_memory_utilization {float} NOT NULL DEFAULT 0.90,
            kv_watermark_pct       {float} NOT NULL DEFAULT 0.02,
            updated_at             {ts} NOT NULL DEFAULT {now})""",
    )),
    Migration(2, "guardrail alerts; columns for the report and for exact config replay", (
        "ALTER TABLE sequences ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE sequences ADD COLUMN finish_reason VARCHAR(16)",
        "ALTER TABLE sequences ADD COLUMN num_preemptions_recompute INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE sequences ADD COLUMN num_preemptions_swap INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE sequences ADD COLUMN queue_wait_ms {float}",
        "ALTER TABLE sequences ADD COLUMN e2e_ms {float}",
        "CREATE INDEX ix_sequences_completed_at ON sequences (completed_at)",
        "CREATE INDEX ix_sequences_tenant_tier ON sequences (tenant_id, priority_tier)",
        "ALTER TABLE scheduler_iterations ADD COLUMN step INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE scheduler_iterations ADD COLUMN num_running INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE scheduler_iterations ADD COLUMN num_waiting INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE scheduler_iterations ADD COLUMN num_preempted INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE scheduler_iterations ADD COLUMN context_tokens BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE scheduler_config ADD COLUMN version INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE scheduler_config ADD COLUMN max_queued_per_tenant INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE scheduler_config ADD COLUMN max_queued_per_tier VARCHAR(32) NOT NULL "
        "DEFAULT '0,0,0'",
        "ALTER TABLE scheduler_config ADD COLUMN source VARCHAR(16) NOT NULL DEFAULT 'startup'",
        "ALTER TABLE scheduler_config ADD COLUMN config_json TEXT NOT NULL DEFAULT '{{}}'",
        """CREATE TABLE alerts (
            alert_id   {id},
            raised_at  {ts} NOT NULL DEFAULT {now},
            kind       VARCHAR(32) NOT NULL,
            tier       SMALLINT,
            request_id TEXT,
            value      {float} NOT NULL,
            threshold  {float} NOT NULL,
            message    TEXT NOT NULL)""",
        "CREATE INDEX ix_alerts_raised_at ON alerts (raised_at)",
    )),
    Migration(3, "the step budget per iteration: fitted step cost, prediction, target, budget", (
        "ALTER TABLE scheduler_iterations ADD COLUMN execute_ms {float} NOT NULL DEFAULT 0",
        "ALTER TABLE scheduler_iterations ADD COLUMN predicted_step_ms {float} NOT NULL "
        "DEFAULT 0",
        "ALTER TABLE scheduler_iterations ADD COLUMN tpot_target_ms {float}",
        "ALTER TABLE scheduler_iterations ADD COLUMN prefill_budget_tokens INTEGER NOT NULL "
        "DEFAULT 0",
        "ALTER TABLE scheduler_iterations ADD COLUMN step_cost_fixed_s {float} NOT NULL "
        "DEFAULT 0",
        "ALTER TABLE scheduler_iterations ADD COLUMN step_cost_prefill_token_s {float} NOT NULL "
        "DEFAULT 0",
        "ALTER TABLE scheduler_iterations ADD COLUMN step_cost_decode_row_s {float} NOT NULL "
        "DEFAULT 0",
        "ALTER TABLE scheduler_iterations ADD COLUMN step_cost_context_token_s {float} NOT NULL "
        "DEFAULT 0",
    )),
)

LATEST_VERSION = MIGRATIONS[-1].version

SCHEMA_VERSION_TABLE = """CREATE TABLE IF NOT EXISTS schema_version (
    version     INTEGER PRIMARY KEY,
    description TEXT NOT NULL,
    applied_at  {ts} NOT NULL DEFAULT {now})"""


def schema_version_ddl(dialect: Dialect) -> str:
    return SCHEMA_VERSION_TABLE.format(**_TYPES[dialect])


def pending(applied: int, target: int = LATEST_VERSION) -> list[Migration]:
    """Migrations after `applied`, up to and including `target`, in order."""
    return [m for m in MIGRATIONS if applied < m.version <= target]
