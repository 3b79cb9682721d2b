"""Telemetry: what the scheduler did, per sequence and per iteration, kept off the hot path.

  schema.py    tables and migrations (SQLite and PostgreSQL from one source)
  store.py     Store interface; open_store("path.db" | "postgresql://...")
  writer.py    bounded queue + writer thread: submit() never blocks, drops are counted
  recorder.py  engine listeners -> rows (TTFT, TPOT p50, queue wait)
  alerts.py    guardrails (prefill ceiling, starvation, KV leak) and their prometheus collector
  service.py   all of the above for one engine (Telemetry / open_telemetry)
  report.py    `everystop report` (text, JSON)
  report_html.py  `everystop report --html`: the same as a page with PNG plots
"""
