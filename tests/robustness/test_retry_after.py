"""Retry-After is the refusing queue's depth over its measured drain rate, not a constant."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from everystop.core.drain_rate import DrainMeter, wait_for
from everystop.core.request import Request
from everystop.core.scheduler import QueueFull
from everystop.sampling_params import SamplingParams
from everystop.server.admission import (
    RETRY_AFTER_MAX_S,
    AdmissionConfig,
    AdmissionController,
    retry_after_header,
)
from everystop.server.errors import APIError
from everystop.server.metrics import ServerMetrics
from everystop.server.serving import _map_submit_error
from tests.core.helpers import Harness, make_harness


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def _burst(h: Harness, tenant: str, priority: int, max_tokens: int) -> list[float]:
    """Offer requests until one is refused; the refusals' Retry-After estimates."""
    refusals = []
    while True:
        req = Request(f"r{len(h.outputs)}", [5, 6, 7, 8],
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      priority=priority, tenant=tenant)
        try:
            h.scheduler.add_request(req)
        except QueueFull as exc:
            refusals.append(exc.retry_after_s)
            return refusals
        h.outputs[req.request_id] = []


def _retry_after_under_burst(cap: int, steps_per_request: int, tier_cap: bool = False
                             ) -> float:
    """One sequence at a time, 10 ms steps: the queue drains one request every
    `steps_per_request` steps. Clients keep it full for 30 s (fake time); the last refusal's
    estimate."""
    caps = dict(max_queued_per_tier=(0, cap, 0)) if tier_cap else \
        dict(max_queued_per_tenant=cap)
    h = make_harness(max_num_seqs=1, **caps)  # type: ignore[arg-type]
    last = math.nan
    while h.clock.now < 31.0:
        last = _burst(h, "acme", 1, max_tokens=steps_per_request)[-1]
        h.step(dt=0.01)
    return last


def test_retry_after_follows_the_depth_and_the_drain_rate_of_the_refusing_queue() -> None:
    # 10 steps of 10 ms per request: 10 leave the queue per second.
    assert _retry_after_under_burst(4, 10) == pytest.approx(4 / 10, rel=0.05)
    assert _retry_after_under_burst(16, 10) == pytest.approx(16 / 10, rel=0.05)
    assert _retry_after_under_burst(16, 20) == pytest.approx(16 / 5, rel=0.05)  # half as fast
    assert _retry_after_under_burst(16, 10, tier_cap=True) == pytest.approx(16 / 10, rel=0.05)


def test_a_stalled_queue_says_ever_longer_and_a_fresh_one_borrows_its_tiers_rate() -> None:
    h = make_harness(max_num_seqs=1, max_queued_per_tenant=4)
    for _ in range(300):  # 3 s of a steady 10 per second
        _burst(h, "acme", 1, max_tokens=10)
        h.step(dt=0.01)
    before = _burst(h, "acme", 1, max_tokens=10)[-1]
    h.clock.now += 20.0  # the engine stalls: nothing leaves
    after = _burst(h, "acme", 1, max_tokens=10)[-1]
    assert after > 5 * before
    # A new tenant's queue, full before any of it moved: its tier's rate stands in.
    fresh = make_harness(max_num_seqs=1, max_queued_per_tenant=4)
    for _ in range(300):
        _burst(fresh, "old", 1, max_tokens=10)
        fresh.step(dt=0.01)
    rate = fresh.scheduler._queued.tier_drain[1].rate(fresh.clock.now)
    assert rate is not None
    assert _burst(fresh, "new", 1, max_tokens=10)[-1] == pytest.approx(4 / rate)


def test_the_meter_recovers_a_steady_rate_at_any_age_and_knows_when_it_knows_nothing() -> None:
    meter = DrainMeter(now=0.0)
    assert meter.rate(5.0) is None and wait_for(3, [meter], 5.0) == math.inf
    for i in range(1, 401):  # 4 per second for 100 s
        meter.leave(i / 4)
        if i in (8, 40, 400):
            assert meter.rate(i / 4) == pytest.approx(4.0, rel=0.15)
    assert wait_for(8, [None, meter], 100.0) == pytest.approx(2.0, rel=0.15)


def test_the_header_is_whole_seconds_between_one_and_the_cap() -> None:
    assert retry_after_header(0.2) == "1"
    assert retry_after_header(1.6) == "2"
    assert retry_after_header(59.5) == "60"
    assert retry_after_header(1e6) == retry_after_header(math.inf) == str(int(RETRY_AFTER_MAX_S))
    assert retry_after_header(math.nan) == str(int(RETRY_AFTER_MAX_S))


def test_a_full_queue_answers_429_with_the_schedulers_estimate() -> None:
    ctx = SimpleNamespace(metrics=ServerMetrics())
    for estimate, header in ((0.3, "1"), (7.2, "8"), (math.inf, "60")):
        err = _map_submit_error(ctx, QueueFull("tenant 'a' has 4 requests queued", estimate), 1)
        assert isinstance(err, APIError) and err.status == 429
        assert err.headers["Retry-After"] == header


def test_the_rate_window_stays_bounded_when_nothing_asks_for_the_rate() -> None:
    clock = Clock()
    ctl = AdmissionController(AdmissionConfig(), max_num_seqs=lambda: 4, num_running=lambda: 4,
                              clock=clock)
    for _ in range(10_000):  # a request a second, no time limit set: no one reads the rate
        clock.t += 1.0
        ctl.done(Request("q", [1, 2], SamplingParams()), completed=True)
    assert len(ctl._finished) <= ctl.config.rate_window_s + 1
