"""Retry-After follows the measured drain rate instead of always saying 1 s."""

from __future__ import annotations

from everystop.core.request import Request, RequestStatus
from everystop.sampling_params import SamplingParams
from everystop.server.admission import RETRY_AFTER_MAX_S, AdmissionConfig, AdmissionController


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def queued(i: int, priority: int, tenant: str, arrival: float) -> Request:
    r = Request(f"q{i}", [1, 2], SamplingParams(), priority=priority, tenant=tenant,
                arrival_time=arrival)
    r.status = RequestStatus.WAITING
    return r


def test_retry_after_is_the_wait_for_the_full_queue_to_move_at_the_measured_rate() -> None:
    clock = Clock()
    ctl = AdmissionController(AdmissionConfig(min_samples=2), max_num_seqs=lambda: 4,
                              num_running=lambda: 4, clock=clock)
    assert ctl.retry_after_s(1, "acme") == 1.0  # no rate measured yet
    # Queue: two premium, then acme's two, then three more standard requests.
    for i, (prio, tenant) in enumerate([(0, "p"), (0, "p"), (1, "acme"), (1, "acme"),
                                        (1, "b"), (1, "b"), (2, "c")]):
        ctl.track(queued(i, prio, tenant, arrival=float(i)))
    for _ in range(5):  # 5 completions in 20 s: 0.25 admissions per second
        clock.t += 4.0
        ctl.done(queued(99, 1, "x", 0.0), completed=True)
    assert ctl.admission_rate() == 0.25
    # acme's first queued request has two premium ones ahead: its seat in 3 admissions.
    assert ctl.retry_after_s(1, "acme") == 3 / 0.25
    # The tier-2 queue moves after all six ahead of its one request: 7 admissions.
    assert ctl.retry_after_s(2) == 7 / 0.25 == 28.0
    for _ in range(3):  # slower drain: the 30 s window now holds 2 completions, 1/15 per s
        clock.t += 20.0
        ctl.done(queued(99, 1, "x", 0.0), completed=True)
    assert ctl.retry_after_s(2) == RETRY_AFTER_MAX_S  # bounded


def test_the_rate_window_stays_bounded_when_nothing_asks_for_the_rate() -> None:
    clock = Clock()
    ctl = AdmissionController(AdmissionConfig(), max_num_seqs=lambda: 4, num_running=lambda: 4,
                              clock=clock)
    for _ in range(10_000):  # a request a second, no time limit set: no one reads the rate
        clock.t += 1.0
        ctl.done(queued(0, 1, "x", 0.0), completed=True)
    assert len(ctl._finished) <= ctl.config.rate_window_s + 1
