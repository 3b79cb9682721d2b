"""Admission control in front of the engine: refuse (429 + Retry-After) work that would wait
longer than its tier tolerates, before it takes a queue slot.

The scheduler itself enforces hard queue caps per tenant and per tier (QueueFull). This layer
adds a soft, time-based limit per priority tier:

    expected_wait(tier) = max(0, ahead + 1 - free_slots) / admission_rate

where `ahead` counts queued requests of the same or a better tier (they will be admitted first),
`free_slots` is how many more sequences may run now, and `admission_rate` is requests finished
per second over a recent window (in a full engine a request is admitted when another finishes).
With no recent completions there is no estimate, and nothing is refused on time grounds.

Retry-After on a 429 is a number of seconds clamped to [1, RETRY_AFTER_MAX_S]
(`retry_after_header`): for a full queue, what the scheduler measured (the queue's depth over
its smoothed drain rate, core/drain_rate.py); for a refused wait, how far the expected wait is
over the tier's limit.

Everything here runs on the event loop thread; it only reads engine state (atomic attribute
reads), never locks it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from everystop.core.request import Request, RequestStatus

_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
RETRY_AFTER_MAX_S = 60.0


@dataclass(frozen=True)
class AdmissionConfig:
    # Per tier (0, 1, 2): refuse when the expected queue wait exceeds this many seconds; 0 = off.
    max_queue_wait_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # Completions older than this do not count towards the admission rate.
    rate_window_s: float = 30.0
    # Fewer completions than this in the window: no estimate yet.
    min_samples: int = 3


class AdmissionRefused(Exception):
    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        return retry_after_header(self.retry_after_s)


def retry_after_header(seconds: float) -> str:
    """A Retry-After value: whole seconds, at least 1, at most RETRY_AFTER_MAX_S (an inf or
    nan estimate, a queue never seen to move, says the most)."""
    if not seconds < RETRY_AFTER_MAX_S:  # also inf and nan
        return str(int(RETRY_AFTER_MAX_S))
    return str(max(1, math.ceil(seconds)))


class AdmissionController:
    def __init__(self, config: AdmissionConfig, max_num_seqs: Callable[[], int],
                 num_running: Callable[[], int], clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.config = config
        self._max_num_seqs = max_num_seqs
        self._num_running = num_running
        self._clock = clock
        self._in_flight: dict[str, Request] = {}
        self._finished: deque[float] = deque()
        self._started = clock()

    # -- bookkeeping (called by the routes) -----------------------------------------------------
    def track(self, req: Request) -> None:
        self._in_flight[req.request_id] = req

    def done(self, req: Request, completed: bool) -> None:
        """The route is finished with `req`; `completed` if it ran to the end (not aborted)."""
        self._in_flight.pop(req.request_id, None)
        if completed:
            now = self._clock()
            self._finished.append(now)
            # Trimmed here too: with no time limit set nothing else reads the rate, and the
            # deque would keep one entry per request ever completed.
            while self._finished[0] < now - self.config.rate_window_s:
                self._finished.popleft()

    # -- the estimate ---------------------------------------------------------------------------
    def admission_rate(self) -> float | None:
        """Requests completed per second over the recent window (None: too few samples)."""
        now = self._clock()
        window = self.config.rate_window_s
        while self._finished and self._finished[0] < now - window:
            self._finished.popleft()
        if len(self._finished) < self.config.min_samples:
            return None
        span = min(window, now - self._started)
        return len(self._finished) / max(span, 1e-3)

    def queued_ahead(self, tier: int) -> int:
        return sum(1 for r in list(self._in_flight.values())
                   if r.status in _QUEUED and r.priority <= tier)

    def expected_wait_s(self, tier: int) -> float | None:
        free = max(0, self._max_num_seqs() - self._num_running())
        behind = self.queued_ahead(tier) + 1 - free
        if behind <= 0:
            return 0.0
        rate = self.admission_rate()
        return None if rate is None else behind / rate

    def check(self, tier: int) -> None:
        """Raise AdmissionRefused if a new request of this tier would wait too long."""
        limit = self.config.max_queue_wait_s[tier]
        if limit <= 0:
            return
        wait = self.expected_wait_s(tier)
        if wait is not None and wait > limit:
            raise AdmissionRefused(
                "expected_wait",
                f"server busy: expected queue wait for priority {tier} is {wait:.1f}s "
                f"(limit {limit:g}s); retry later", retry_after_s=wait - limit)
