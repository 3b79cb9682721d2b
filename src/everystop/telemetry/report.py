"""`everystop report`: per-tenant and per-tier latency percentiles, preemption rates and the
guardrail alerts, from a telemetry store - the breakdown that aggregate throughput hides."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from everystop.stats import percentile
from everystop.telemetry.rows import AlertRow, ConfigRow, IterationRow, SequenceRow
from everystop.telemetry.store import Store, fetch_range, is_postgres_dsn, open_store

METRICS = (("queue_wait", "queue_wait_ms"), ("ttft", "ttft_ms"), ("tpot", "tpot_p50_ms"))


def _group_summary(rows: list[SequenceRow]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests": len(rows),
        "aborted": sum(r.status == "aborted" for r in rows),
        "prompt_tokens": sum(r.prompt_tokens for r in rows),
        "cached_tokens": sum(r.cached_tokens for r in rows),
        "generated_tokens": sum(r.generated_tokens for r in rows),
        "preemptions": sum(r.preemption_count for r in rows),
    }
    for name, field in METRICS:
        values = [getattr(r, field) for r in rows if getattr(r, field) is not None]
        out[f"{name}_p50_ms"] = percentile(values, 50)
        out[f"{name}_p99_ms"] = percentile(values, 99)
    # Both views: preemptions per request (cost) and share of requests hit at least once (reach).
    out["preemptions_per_request"] = out["preemptions"] / len(rows) if rows else 0.0
    out["preempted_fraction"] = (sum(r.preemption_count > 0 for r in rows) / len(rows)
                                 if rows else 0.0)
    return out


def _by(rows: Iterable[SequenceRow], key: str) -> dict[Any, list[SequenceRow]]:
    groups: dict[Any, list[SequenceRow]] = {}
    for r in rows:
        groups.setdefault(getattr(r, key), []).append(r)
    return dict(sorted(groups.items()))


def build_report(store: Store, *, since: float | None = None, until: float | None = None,
                 recent_alerts: int = 20) -> dict[str, Any]:
    """The report as plain data (what --json prints). `since`, `until`: epoch seconds."""
    seqs = fetch_range(store, SequenceRow, since, until)
    iters = fetch_range(store, IterationRow, since, until)
    alerts = fetch_range(store, AlertRow, since, until)
    configs = fetch_range(store, ConfigRow, since, until)
    counts = Counter((a.kind, a.tier) for a in alerts)
    latencies = [i.iteration_latency_ms for i in iters]
    return {
        "since": since,
        "until": until,
        "overall": _group_summary(seqs),
        "tenants": [{"tenant": k, **_group_summary(v)} for k, v in _by(seqs, "tenant_id").items()],
        "tiers": [{"tier": k, **_group_summary(v)} for k, v in _by(seqs, "priority_tier").items()],
        "tenant_tiers": [{"tenant": tenant, "tier": tier, **_group_summary(v)}
                         for tenant, group in _by(seqs, "tenant_id").items()
                         for tier, v in _by(group, "priority_tier").items()],
        "iterations": {
            "count": len(iters),
            "mean_batch_size": sum(i.batch_size for i in iters) / len(iters) if iters else 0.0,
            "prefill_tokens": sum(i.num_prefill_tokens for i in iters),
            "decode_tokens": sum(i.num_decode_tokens for i in iters),
            "latency_p50_ms": percentile(latencies, 50),
            "latency_p99_ms": percentile(latencies, 99),
            "max_prefill_tokens": max((i.num_prefill_tokens for i in iters), default=0),
        },
        "alerts": {
            "counts": [{"kind": k, "tier": t, "count": n}
                       for (k, t), n in sorted(counts.items(), key=lambda kv: str(kv[0]))],
            "recent": [{"raised_at": a.raised_at, "kind": a.kind, "tier": a.tier,
                        "request_id": a.request_id, "value": a.value, "threshold": a.threshold,
                        "message": a.message} for a in alerts[-recent_alerts:]],
        },
        "config_versions": [{"version": c.version, "source": c.source,
                             "updated_at": c.updated_at, "max_num_seqs": c.max_num_seqs,
                             "max_num_batched_tokens": c.max_num_batched_tokens,
                             "chunk_size": c.chunk_size, "watermark": c.kv_watermark_pct}
                            for c in configs],
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 1 else f"{v:.2f}"
    return str(v)


_COLUMNS = (("requests", "reqs"), ("aborted", "aborted"), ("queue_wait_p50_ms", "queue p50"),
            ("queue_wait_p99_ms", "queue p99"), ("ttft_p50_ms", "ttft p50"),
            ("ttft_p99_ms", "ttft p99"), ("tpot_p50_ms", "tpot p50"), ("tpot_p99_ms", "tpot p99"),
            ("preemptions_per_request", "preempt/req"), ("preempted_fraction", "preempted"))


def _table(title: str, key: str, groups: list[dict[str, Any]]) -> list[str]:
    header = [key] + [label for _, label in _COLUMNS]
    body = [[_fmt(g[key])] + [_fmt(g[f]) for f, _ in _COLUMNS] for g in groups]
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return [title, line(header), line(["-" * w for w in widths])] + [line(r) for r in body] + [""]


def format_table(report: dict[str, Any]) -> str:
    """The report as text tables (latencies in milliseconds)."""
    out = ["latencies in ms; tpot = per-request median time per output token", ""]
    out += _table("per tenant", "tenant", report["tenants"])
    out += _table("per priority tier (0 premium, 1 standard, 2 best-effort)", "tier",
                  report["tiers"])
    it = report["iterations"]
    out.append(f"iterations: {it['count']}, mean batch {_fmt(it['mean_batch_size'])}, "
               f"latency p50 {_fmt(it['latency_p50_ms'])} ms, p99 {_fmt(it['latency_p99_ms'])} "
               f"ms, max prefill tokens {it['max_prefill_tokens']}")
    out.append(f"config versions: {len(report['config_versions'])}")
    out.append("")
    alerts = report["alerts"]
    if not alerts["counts"]:
        out.append("alerts: none")
    else:
        out.append("alerts: " + ", ".join(
            f"{a['kind']}{'' if a['tier'] is None else ' tier ' + str(a['tier'])} x{a['count']}"
            for a in alerts["counts"]))
        for a in alerts["recent"]:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a["raised_at"]))
            out.append(f"  {stamp}  {a['kind']}: {a['message']}")
    return "\n".join(out) + "\n"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("report", help="per-tenant / per-tier latency report from the "
                              "telemetry store")
    p.add_argument("--db", required=True,
                   help="the telemetry store: a SQLite path or a postgresql:// DSN")
    p.add_argument("--since", type=float, default=None, metavar="SECONDS",
                   help="only the last SECONDS (default: everything)")
    p.add_argument("--start", type=_when, default=None, metavar="TIME",
                   help="only from TIME: ISO 8601 (local time unless it says) or epoch seconds")
    p.add_argument("--end", type=_when, default=None, metavar="TIME",
                   help="only up to TIME (same forms as --start)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--html", default=None, metavar="OUT.html",
                   help="also write an HTML report with PNG plots beside it (needs matplotlib)")
    p.set_defaults(func=main)


def _when(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ISO 8601 (2026-12-01T13:05) or epoch seconds, got {text!r}") from None


def main(args: argparse.Namespace) -> int:
    if not is_postgres_dsn(args.db) and not os.path.exists(args.db):
        print(f"everystop report: no telemetry database at {args.db}", file=sys.stderr)
        return 2
    since = None if args.since is None else time.time() - args.since
    if args.start is not None:
        since = args.start if since is None else max(since, args.start)
    until = args.end
    store = open_store(args.db)
    try:
        report = build_report(store, since=since, until=until)
        if args.html:
            from everystop.telemetry.report_html import write_html_report

            files = write_html_report(store, report, args.html)
            print(f"everystop report: wrote {', '.join(files)}", file=sys.stderr)
    finally:
        store.close()
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_table(report))
    return 0
