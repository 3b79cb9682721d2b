"""Per-request timings -> the summary numbers users compare serving engines by.

Pure functions over `RequestResult`s, shared by the HTTP client and the in-process runner, so a
number means the same thing whichever produced it:

    send ──── TTFT ────▶ tok1 ─ITL─▶ tok2 ─ITL─▶ ... ─ITL─▶ tokN (= end)
         └────────────────────── E2E ───────────────────────────┘
    TPOT = (E2E - TTFT) / (N - 1): the decode rate the user sees after the first token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from everystop.stats import percentile


@dataclass
class RequestResult:
    id: str
    prompt_len: int
    max_tokens: int
    priority: int = 1
    tenant: str = "default"
    success: bool = True
    error: str = ""
    output_tokens: int = 0
    # Seconds since the run started: when the request was due, and when it was actually sent.
    scheduled_s: float = 0.0
    sent_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Goodput counts a request only if it meets every SLO that is set (milliseconds)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, r: RequestResult) -> bool:
        if not r.success:
            return False
        checks = ((self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2e_ms, r.e2e_s))
        return all(limit is None or value is None or value * 1000 <= limit
                   for limit, value in checks)

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


def distribution_ms(values_s: list[float]) -> dict[str, float]:
    """mean/p50/p90/p99 (and count) in milliseconds."""
    ms = [v * 1000 for v in values_s]
    mean = sum(ms) / len(ms) if ms else math.nan
    nan = math.nan  # the run reports print nan for no data
    return {"mean": mean, "p50": percentile(ms, 50, empty=nan),
            "p90": percentile(ms, 90, empty=nan), "p99": percentile(ms, 99, empty=nan),
            "n": len(ms)}


def summarize(results: list[RequestResult], duration_s: float,
              slo: SLO | None = None) -> dict[str, Any]:
    """Throughput and latency distributions for one set of requests over one wall duration."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    dur = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration_s, "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / dur, "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": distribution_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok]),
    }
    if slo is not None and slo.is_set:
        good = sum(1 for r in ok if slo.met_by(r))
        summary["goodput"] = {"requests_per_s": good / dur, "fraction": good / max(1, len(results)),
                              "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms,
                                      "e2e_ms": slo.e2e_ms}}
    return summary


def summarize_by(results: list[RequestResult], key: Callable[[RequestResult], Any],
                 duration_s: float, slo: SLO | None = None) -> dict[str, dict[str, Any]]:
    """The same summary per group (tier, tenant), over the whole run's duration: a tenant's
    throughput is its share of the run, and its latencies are what its users saw."""
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(str(key(r)), []).append(r)
    return {k: summarize(v, duration_s, slo) for k, v in sorted(groups.items())}


def full_report(results: list[RequestResult], duration_s: float,
                slo: SLO | None = None) -> dict[str, Any]:
    """Summary + per-tier + per-tenant breakdowns + raw per-request samples (the gate and the
    plots read those)."""
    return {
        "summary": summarize(results, duration_s, slo),
        "by_priority": summarize_by(results, lambda r: r.priority, duration_s, slo),
        "by_tenant": summarize_by(results, lambda r: r.tenant, duration_s, slo),
        "requests": [_request_row(r) for r in results],
    }


def _request_row(r: RequestResult) -> dict[str, Any]:
    return {"id": r.id, "priority": r.priority, "tenant": r.tenant, "prompt_len": r.prompt_len,
            "max_tokens": r.max_tokens, "output_tokens": r.output_tokens, "success": r.success,
            "error": r.error, "scheduled_s": r.scheduled_s, "sent_s": r.sent_s,
            "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s,
            "itl_s": [round(x, 6) for x in r.itl_s]}


def format_summary(s: dict[str, Any], title: str = "") -> str:
    """A vLLM-bench-style text block."""
    lines = [f"{'=' * 16} {title or 'Serving Benchmark Result'} {'=' * 16}"]
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["input_tokens"]),
            ("Total generated tokens", s["output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    if "goodput" in s:
        rows.append(("Goodput (req/s)", f"{s['goodput']['requests_per_s']:.2f}"))
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                      ("E2E", "e2e_ms")):
        d = s[key]
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{stat.capitalize() if stat == 'mean' else stat.upper()} {name} (ms)",
                         f"{d[stat]:.2f}"))
    lines += [f"{k:<40}{v:>12}" for k, v in rows]
    return "\n".join(lines)
