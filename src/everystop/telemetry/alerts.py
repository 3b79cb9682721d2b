"""Guardrails: the soft failures aggregate throughput hides, turned into alerts and metrics.

  prefill_ceiling  an iteration ran more prefill tokens than the ceiling (decode stutter)
  starvation       a tier's p99 queue wait (recent admissions + requests still waiting)
                   exceeds its SLA
  kv_leak          device blocks held by a live sequence that made no progress over N engine
                   iterations (and at least S seconds), or by an id the scheduler no longer
                   knows for S seconds. Iterations, not seconds alone: a slow step (30 s on a
                   loaded CPU) is not a leak, and every step advances every running sequence.
  tpot_overrun     N steps in a row ran longer than their TPOT target (plus a tolerance); the
                   message says when the decodes alone were predicted over the target (no
                   prefill budget can meet it: the target is below this machine's decode
                   step at that batch size; the step-cost fit on /metrics shows it)
  loop_lag         the server's event loop woke a sleeping task this late (seconds) or later:
                   work ran on the loop, and every stream and /health waited for it

Auto-clamp: a prefill-ceiling breach (with a ceiling set below max_num_batched_tokens), or a
run of overruns in steps that carried prefill the budget predicted within the target, lasting
longer than the step-cost model takes to follow the machine, also proposes a lower
max_num_batched_tokens:
the ceiling, or the overrunning steps' mean token count scaled by target / measured time.
Whoever drains the proposals applies them (`clamp_change`), logs them and records them in the
config history; a clamp only ever lowers the cap, and an operator lifts it with a PATCH.

Threading: `on_iteration` / `on_finish` run on the engine thread and only count and queue;
`check` reads scheduler state and must run under the engine lock (the monitor thread takes it);
`drain` hands queued alerts to whoever logs and stores them, outside the lock. The engine thread
never logs or does I/O here.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from everystop.core.outputs import IterationRecord
from everystop.core.request import Request, RequestStatus
from everystop.stats import percentile

KINDS = ("prefill_ceiling", "starvation", "kv_leak", "tpot_overrun", "loop_lag")
NUM_TIERS = 3


@dataclass(frozen=True)
class GuardrailConfig:
    # None: the scheduler's current max_num_batched_tokens (follows hot reloads).
    prefill_ceiling: int | None = None
    # p99 queue-wait SLA per priority tier (premium, standard, best-effort), seconds.
    tier_queue_sla_s: tuple[float, float, float] = (1.0, 5.0, 30.0)
    sla_window_s: float = 60.0
    leak_after_s: float = 30.0
    leak_after_steps: int = 64
    check_interval_s: float = 1.0
    # A prefill-ceiling breach is counted every iteration but reported at most this often.
    report_every_s: float = 10.0
    # A step overruns when its measured time exceeds its TPOT target by this fraction; this
    # many overruns in a row raise an alert.
    overrun_tolerance: float = 0.25
    overrun_steps: int = 8
    # Propose a lower max_num_batched_tokens on a breach or an overrun run (see above).
    auto_clamp: bool = True
    # ... an overrun run only once it has lasted this many steps: the step-cost model follows
    # the machine within about 1 / (1 - forgetting) = 50 steps, and the budget with it, while
    # a clamp stays until an operator lifts it. A shorter burst is a neighbour's spike (a
    # premium run on the loaded CPU: 8 steps at 352 ms against 198 predicted clamped the cap
    # to 144 tokens for the server's life).
    clamp_after_steps: int = 50
    # An event-loop lag sample this long (seconds) counts a loop_lag alert (reported at most
    # every report_every_s).
    loop_lag_alert_s: float = 0.5


@dataclass(frozen=True)
class Alert:
    time: float  # engine clock
    kind: str
    tier: int | None
    request_id: str | None
    value: float
    threshold: float
    message: str


class Guardrails:
    def __init__(self, config: GuardrailConfig | None = None) -> None:
        self.config = config or GuardrailConfig()
        self._lock = threading.Lock()
        self._pending: deque[Alert] = deque(maxlen=1000)  # bounded: nobody draining is harmless
        self.alerts_total: Counter[tuple[str, str]] = Counter()  # (kind, tier or "")
        self.queue_wait_p99_s: dict[int, float] = {t: 0.0 for t in range(NUM_TIERS)}
        self.suspected_leaked_blocks = 0
        self.max_prefill_tokens = 0
        self._prefill_breaches = 0  # since the last report
        self._last_prefill_report = -float("inf")
        self._last_lag_report = -float("inf")
        self._waits: dict[int, deque[tuple[float, float]]] = {
            t: deque() for t in range(NUM_TIERS)}  # (admitted at, queue wait)
        self._sampled: set[str] = set()
        self._starving: set[int] = set()
        # rid -> (progress key, since (clock), since (scheduler step))
        self._progress: dict[str, tuple[Any, float, int]] = {}
        self._leak_alerted: set[str] = set()
        self._overruns: list[IterationRecord] = []  # the current run of overrunning steps
        self._overrun_streak = 0  # its length, across the alerts it raised
        self._clamps: deque[tuple[int, str]] = deque(maxlen=16)  # (proposed cap, why)

    # -- engine thread --------------------------------------------------------------------------
    def on_iteration(self, record: IterationRecord, max_num_batched_tokens: int) -> None:
        self._check_overrun(record)
        ceiling = self.config.prefill_ceiling or max_num_batched_tokens
        n = record.num_prefill_tokens
        self.max_prefill_tokens = max(self.max_prefill_tokens, n)
        if n <= ceiling:
            return
        with self._lock:
            if self.config.auto_clamp and ceiling < max_num_batched_tokens:
                self._clamps.append((ceiling, f"iteration {record.step} ran {n} prefill "
                                              f"tokens, over the ceiling of {ceiling}"))
            self.alerts_total[("prefill_ceiling", "")] += 1
            self._prefill_breaches += 1
            if record.time - self._last_prefill_report >= self.config.report_every_s:
                self._pending.append(Alert(
                    record.time, "prefill_ceiling", None, None, n, ceiling,
                    f"iteration {record.step} ran {n} prefill tokens, over the ceiling of "
                    f"{ceiling} ({self._prefill_breaches} such iterations since the last report)"))
                self._last_prefill_report = record.time
                self._prefill_breaches = 0

    def _check_overrun(self, record: IterationRecord) -> None:
        target = record.tpot_target_s
        if not target or record.execute_s <= target * (1 + self.config.overrun_tolerance):
            self._overruns.clear()
            self._overrun_streak = 0
            return
        self._overruns.append(record)
        self._overrun_streak += 1
        if len(self._overruns) < self.config.overrun_steps:
            return
        run, self._overruns = self._overruns, []
        mean_s = sum(r.execute_s for r in run) / len(run)
        floor_s = decode_floor_s(record)
        infeasible = (f"; the {record.num_decode_tokens} decodes alone are predicted at "
                      f"{1e3 * floor_s:.0f} ms: the target is below this machine's decode step "
                      f"at this batch size" if floor_s > target else "")
        with self._lock:
            self._raise(Alert(record.time, "tpot_overrun", None, None, mean_s, target,
                              f"{len(run)} steps in a row overran the TPOT target of "
                              f"{1e3 * target:.0f} ms (mean {1e3 * mean_s:.0f} ms, predicted "
                              f"{1e3 * run[-1].predicted_s:.0f} ms){infeasible}"))
            # NOTE: only steps whose prefill the budget admitted believing the step fit its
            # target (predicted <= target) say the cap is too high. A step predicted over its
            # target got its prefill from the anti-starvation floor, or carried decodes that
            # alone overrun (a machine slower than the target, a loaded neighbour): a lower cap
            # cannot speed up decodes and would only slow the starving prompts the floor
            # protects - and a clamp stays until an operator lifts it.
            if (self.config.auto_clamp
                    and self._overrun_streak >= self.config.clamp_after_steps
                    and any(r.num_prefill_tokens and r.predicted_s <= target for r in run)):
                self._overrun_streak = 0
                tokens = sum(r.num_prefill_tokens + r.num_decode_tokens for r in run) / len(run)
                self._clamps.append((int(tokens * target / mean_s),
                                     f"{len(run)} steps in a row overran {1e3 * target:.0f} ms"))

    def on_loop_lag(self, lag_s: float, now: float) -> None:
        """One event-loop lag sample (the server's loop thread; `now`: the engine clock)."""
        threshold = self.config.loop_lag_alert_s
        if lag_s < threshold:
            return
        with self._lock:
            self.alerts_total[("loop_lag", "")] += 1
            if now - self._last_lag_report >= self.config.report_every_s:
                self._last_lag_report = now
                self._pending.append(Alert(
                    now, "loop_lag", None, None, lag_s, threshold,
                    f"the event loop stalled {lag_s:.2f}s (alert at {threshold:g}s): work ran "
                    "on it, and every stream and /health waited"))

    def drain_clamps(self) -> list[tuple[int, str]]:
        """Proposed max_num_batched_tokens caps, with the reason, since the last drain."""
        with self._lock:
            clamps = list(self._clamps)
            self._clamps.clear()
        return clamps

    def on_finish(self, req: Request) -> None:
        with self._lock:
            if req.request_id not in self._sampled:
                self._sample_wait(req)
            self._sampled.discard(req.request_id)

    def _sample_wait(self, req: Request) -> None:
        if req.admitted_time is not None and 0 <= req.priority < NUM_TIERS:
            self._waits[req.priority].append(
                (req.admitted_time, req.admitted_time - req.arrival_time))

    # -- monitor (under the engine lock) ----------------------------------------------------------
    def check(self, scheduler: Any, now: float) -> None:
        """Evaluate starvation and leak guardrails against live scheduler state."""
        with self._lock:
            self._check_starvation(scheduler, now)
            self._check_leaks(scheduler, now)

    def _check_starvation(self, scheduler: Any, now: float) -> None:
        waiting: dict[int, list[float]] = {t: [] for t in range(NUM_TIERS)}
        for req in scheduler.requests.values():
            if req.admitted_time is None:
                if 0 <= req.priority < NUM_TIERS:
                    waiting[req.priority].append(now - req.arrival_time)
            elif req.request_id not in self._sampled:
                self._sampled.add(req.request_id)
                self._sample_wait(req)
        horizon = now - self.config.sla_window_s
        for tier in range(NUM_TIERS):
            samples = self._waits[tier]
            while samples and samples[0][0] < horizon:
                samples.popleft()
            p99 = percentile([w for _, w in samples] + waiting[tier], 99) or 0.0
            self.queue_wait_p99_s[tier] = p99
            sla = self.config.tier_queue_sla_s[tier]
            if p99 > sla and tier not in self._starving:
                self._starving.add(tier)
                self._raise(Alert(now, "starvation", tier, None, p99, sla,
                                  f"tier {tier} p99 queue wait {p99:.2f}s exceeds its SLA of "
                                  f"{sla:.2f}s ({len(waiting[tier])} still waiting)"))
            elif p99 <= sla:
                self._starving.discard(tier)  # episode over: the next breach alerts again

    def _check_leaks(self, scheduler: Any, now: float) -> None:
        held = scheduler.kv.req_blocks
        for rid in [r for r in self._progress if r not in held]:
            del self._progress[rid]
            self._leak_alerted.discard(rid)
        suspected = 0
        for rid, blocks in held.items():
            if not blocks:
                continue
            req = scheduler.requests.get(rid)
            key = None if req is None else (req.num_computed_tokens, req.num_output_tokens,
                                            int(req.status))
            prev = self._progress.get(rid)
            step = scheduler.num_steps
            if prev is None or prev[0] != key:
                self._progress[rid] = (key, now, step)
                continue
            stalled = now - prev[1]
            idle_steps = step - prev[2]
            if stalled < self.config.leak_after_s or (
                    req is not None and idle_steps < self.config.leak_after_steps):
                continue
            suspected += len(blocks)
            if rid not in self._leak_alerted:
                self._leak_alerted.add(rid)
                state = "unknown to the scheduler" if req is None else RequestStatus(
                    req.status).name.lower()
                self._raise(Alert(now, "kv_leak", None if req is None else req.priority, rid,
                                  stalled, self.config.leak_after_s,
                                  f"{len(blocks)} KV blocks held by {rid} ({state}) with no "
                                  f"progress for {idle_steps} iterations ({stalled:.1f}s): "
                                  "suspected leak"))
        self.suspected_leaked_blocks = suspected

    def _raise(self, alert: Alert) -> None:
        tier = "" if alert.tier is None else str(alert.tier)
        self.alerts_total[(alert.kind, tier)] += 1
        self._pending.append(alert)

    # -- reporting (any thread, outside the engine lock) -----------------------------------------
    def drain(self) -> list[Alert]:
        with self._lock:
            alerts = list(self._pending)
            self._pending.clear()
        return alerts


def decode_floor_s(record: IterationRecord) -> float:
    """What the step-cost model fitted after this step predicts for its decodes alone: the
    least any step carrying them can take, whatever the budget. Their context is counted only
    in a pure-decode step (in a mixed one the record's context includes the prefill rows'), so
    a mixed step gets a lower bound."""
    c = record.step_cost
    if not c:
        return 0.0
    context = record.context_tokens if record.num_prefill_tokens == 0 else 0
    return (c.get("fixed", 0.0) + c.get("decode_row", 0.0) * record.num_decode_tokens
            + c.get("context_token", 0.0) * context)


# Prefill tokens a clamped cap always leaves beside a full decode batch: prompts keep moving.
MIN_PREFILL_ROOM = 16  # one KV block at the default block size


def clamp_change(config: Any, proposed_cap: int) -> dict[str, int] | None:
    """The config change that applies a proposed cap to a SchedulerConfig: never below a full
    decode batch plus MIN_PREFILL_ROOM prefill tokens (a cap of max_num_seqs alone
    starved every prompt in a soak: 6 tokens a step, 200 requests queued), never a raise;
    None when nothing changes."""
    cap = max(int(proposed_cap), config.max_num_seqs + MIN_PREFILL_ROOM)
    if cap >= config.max_num_batched_tokens:
        return None
    return {"max_num_batched_tokens": cap}


def register_alert_metrics(registry: Any, guardrails: Guardrails, writer: Any = None) -> Any:
    """Expose the guardrails (and the telemetry writer's queue, if given) on a prometheus
    CollectorRegistry; values are read at scrape time, so the hot path never touches
    prometheus. Returns the collector (unregister it with `registry.unregister`)."""
    collector = _TelemetryCollector(guardrails, writer)
    registry.register(collector)
    return collector


class _TelemetryCollector:
    def __init__(self, guardrails: Guardrails, writer: Any) -> None:
        self.guardrails = guardrails
        self.writer = writer

    def describe(self) -> list[Any]:
        return []  # no duplicate-name check against a live scrape; names are unique below

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g = self.guardrails
        alerts = CounterMetricFamily("everystop:guardrail_alerts",
                                     "Guardrail alerts raised, by kind and tier.",
                                     labels=["kind", "tier"])
        for kind in KINDS:  # zeros included: dashboards see the series before the first alert
            tiers = ([""] if kind in ("prefill_ceiling", "tpot_overrun", "loop_lag")
                     else [""] + [str(t) for t in range(3)])
            for tier in tiers:
                alerts.add_metric([kind, tier], g.alerts_total.get((kind, tier), 0))
        yield alerts
        p99 = GaugeMetricFamily("everystop:queue_wait_p99_seconds",
                                "p99 queue wait per priority tier over the SLA window "
                                "(includes requests still waiting).", labels=["tier"])
        for tier, value in sorted(g.queue_wait_p99_s.items()):
            p99.add_metric([str(tier)], value)
        yield p99
        yield GaugeMetricFamily("everystop:suspected_leaked_kv_blocks",
                                "Device KV blocks held by sequences with no progress for the "
                                "leak timeout.", value=g.suspected_leaked_blocks)
        yield GaugeMetricFamily("everystop:max_prefill_tokens_per_iteration",
                                "Largest prefill token count seen in one iteration.",
                                value=g.max_prefill_tokens)
        w = self.writer
        if w is None:
            return
        submitted = CounterMetricFamily("everystop:telemetry_events",
                                        "Telemetry items queued for the store.", labels=["kind"])
        dropped = CounterMetricFamily("everystop:telemetry_dropped",
                                      "Telemetry items dropped because the queue was full.",
                                      labels=["kind"])
        for kind in sorted(set(w.submitted) | set(w.dropped)):
            submitted.add_metric([kind], w.submitted.get(kind, 0))
            dropped.add_metric([kind], w.dropped.get(kind, 0))
        yield submitted
        yield dropped
        written = CounterMetricFamily("everystop:telemetry_rows_written",
                                      "Rows written to the telemetry store.", labels=["table"])
        for table, n in sorted(w.written.items()):
            written.add_metric([table], n)
        yield written
        yield CounterMetricFamily("everystop:telemetry_write_errors",
                                  "Telemetry batches lost to store errors.",
                                  value=w.num_write_errors)
        yield GaugeMetricFamily("everystop:telemetry_queue_depth",
                                "Telemetry items waiting for the writer thread.",
                                value=w.queue_depth)
