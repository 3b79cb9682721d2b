"""The last minute of requests, tokens and refusals, summarized for the live /dashboard page.

Fed by ServerMetrics from the same events as its histograms (finishes and iterations on the
engine thread, inter-token gaps and 429s on the event loop), so the page and /metrics agree;
unlike a histogram it keeps raw samples, so its percentiles are exact over the window.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from everystop.core.outputs import IterationRecord, RequestMetrics
from everystop.stats import percentile


@dataclass(frozen=True)
class FinishedSample:
    at: float
    tenant: str
    tier: int
    ttft_s: float | None
    tpot_s: float | None
    queue_s: float | None
    e2e_s: float | None
    generated_tokens: int


@dataclass(frozen=True)
class GapSample:
    at: float
    tenant: str
    tier: int
    gap_s: float
    count: int


class LiveWindow:
    """Args:
        window_s: how far back summaries look.
        max_samples: per kind, a bound on memory whatever the load.

    Samples older than the window are dropped as new ones arrive: trimmed only when the page
    was viewed, the deques of a server nobody watched grew to max_samples each (one gap sample
    per token: ~10 MB of RSS per kind on the way).
        clock: seconds, monotonic.
    """

    def __init__(self, window_s: float = 60.0, max_samples: int = 50_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._finished: deque[FinishedSample] = deque(maxlen=max_samples)
        self._gaps: deque[GapSample] = deque(maxlen=max_samples)
        self._steps: deque[tuple[float, int, int]] = deque(maxlen=max_samples)
        self._rejected: deque[tuple[float, str, int]] = deque(maxlen=max_samples)

    # -- feeding (any thread) -------------------------------------------------------------------
    def on_iteration(self, record: IterationRecord) -> None:
        now = self.clock()
        with self._lock:
            self._steps.append((now, record.num_prefill_tokens, record.num_decode_tokens))
            while self._steps[0][0] < now - self.window_s:
                self._steps.popleft()

    def on_finished(self, tenant: str, tier: int, m: RequestMetrics | None,
                    tpot_s: float | None, generated_tokens: int) -> None:
        e2e = None if m is None or m.finished_time is None else m.finished_time - m.arrival_time
        sample = FinishedSample(self.clock(), tenant, tier, None if m is None else m.ttft_s,
                                tpot_s, None if m is None else m.queue_wait_s, e2e,
                                generated_tokens)
        with self._lock:
            self._finished.append(sample)
            while self._finished[0].at < sample.at - self.window_s:
                self._finished.popleft()

    def on_itl(self, tenant: str, tier: int, gap_s: float, count: int) -> None:
        now = self.clock()
        with self._lock:
            self._gaps.append(GapSample(now, tenant, tier, gap_s, count))
            while self._gaps[0].at < now - self.window_s:
                self._gaps.popleft()

    def on_rejected(self, reason: str, tier: int) -> None:
        now = self.clock()
        with self._lock:
            self._rejected.append((now, reason, tier))
            while self._rejected[0][0] < now - self.window_s:
                self._rejected.popleft()

    # -- reading ----------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Rates and exact percentiles over the window, overall, per tier, per tenant and per
        (tenant, tier)."""
        now = self.clock()
        since = now - self.window_s
        with self._lock:
            finished = [s for s in self._finished if s.at >= since]
            gaps = [g for g in self._gaps if g.at >= since]
            steps = [s for s in self._steps if s[0] >= since]
            rejected = [r for r in self._rejected if r[0] >= since]
        # Rates over the span actually observed (a fresh server has less than a window).
        firsts = [x.at for x in finished[:1]] + [g.at for g in gaps[:1]] + \
            [s[0] for s in steps[:1]]
        span = max(1.0, now - min(firsts)) if firsts else self.window_s
        groups: dict[tuple[str, int], tuple[list[FinishedSample], list[GapSample]]] = {}
        for f in finished:
            groups.setdefault((f.tenant, f.tier), ([], []))[0].append(f)
        for g in gaps:
            groups.setdefault((g.tenant, g.tier), ([], []))[1].append(g)
        rows = [{"tenant": tenant, "tier": tier, **_stats(fs, gs, span)}
                for (tenant, tier), (fs, gs) in sorted(groups.items())]
        by_tier = {str(t): _stats([f for f in finished if f.tier == t],
                                  [g for g in gaps if g.tier == t], span)
                   for t in sorted({k[1] for k in groups})}
        by_tenant = {name: _stats([f for f in finished if f.tenant == name],
                                  [g for g in gaps if g.tenant == name], span)
                     for name in sorted({k[0] for k in groups})}
        reasons: dict[str, int] = {}
        for _, reason, _tier in rejected:
            reasons[reason] = reasons.get(reason, 0) + 1
        return {
            "window_s": self.window_s, "span_s": span,
            "prompt_tokens_per_s": sum(s[1] for s in steps) / span,
            "generation_tokens_per_s": sum(s[2] for s in steps) / span,
            "overall": _stats(finished, gaps, span),
            "by_tier": by_tier, "by_tenant": by_tenant, "rows": rows,
            "rejected_per_s": {k: v / span for k, v in sorted(reasons.items())},
        }


def _pcts(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    data = [v for v in values if v is not None]
    return percentile(data, 50), percentile(data, 99)


def _stats(finished: list[FinishedSample], gaps: list[GapSample],
           span: float) -> dict[str, Any]:
    ttft50, ttft99 = _pcts(f.ttft_s for f in finished)
    tpot50, tpot99 = _pcts(f.tpot_s for f in finished)
    queue50, queue99 = _pcts(f.queue_s for f in finished)
    _, e2e99 = _pcts(f.e2e_s for f in finished)
    # One gap per token that reached the client (a gap that carried k tokens counts k times).
    itl = [g.gap_s for g in gaps for _ in range(g.count)]
    itl50, itl99 = _pcts(itl)
    return {"requests": len(finished), "requests_per_s": len(finished) / span,
            "ttft_p50_s": ttft50, "ttft_p99_s": ttft99, "tpot_p50_s": tpot50,
            "tpot_p99_s": tpot99, "itl_p50_s": itl50, "itl_p99_s": itl99,
            "queue_p50_s": queue50, "queue_p99_s": queue99, "e2e_p99_s": e2e99,
            "generation_tokens_per_s": sum(f.generated_tokens for f in finished) / span,
            "streamed_tokens": len(itl)}
