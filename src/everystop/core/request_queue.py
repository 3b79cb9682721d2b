"""A queue of requests ordered by priority tier with aging, then arrival.

A request's effective priority is `tier - waited / aging_interval_s`: every aging interval it
waits, it climbs one tier. Since every waiting request ages at the same rate, the order of two
requests never changes while they wait, so the queue is a plain sorted list on the constant key
`tier * aging_interval_s + arrival_time`.

NOTE (the starvation bound): a request of tier p arriving at t runs ahead of every request of
tier q arriving after t + (p - q) * aging_interval_s. So at most the higher-tier requests that
arrive within `p * aging_interval_s` of it (2 intervals for best-effort) can overtake it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from everystop.core.request import Request


class RequestQueue:
    def __init__(self, aging_interval_s: float) -> None:
        self.aging_interval_s = aging_interval_s
        self._keys: list[tuple[float, int]] = []
        self._reqs: list[Request] = []
        self._counter = 0

    def key(self, req: Request) -> float:
        return req.priority * self.aging_interval_s + req.arrival_time

    def push(self, req: Request) -> None:
        self._counter += 1
        k = (self.key(req), self._counter)
        i = bisect.bisect_right(self._keys, k)
        self._keys.insert(i, k)
        self._reqs.insert(i, req)

    def peek(self) -> Request:
        return self._reqs[0]

    def pop(self) -> Request:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def remove(self, req: Request) -> bool:
        for i, r in enumerate(self._reqs):
            if r is req:
                del self._keys[i]
                del self._reqs[i]
                return True
        return False

    def reorder(self, aging_interval_s: float) -> None:
        """Re-sort after the aging knob changes (hot reload)."""
        reqs = list(self._reqs)
        self.aging_interval_s = aging_interval_s
        self._keys, self._reqs = [], []
        for r in reqs:
            self.push(r)

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._reqs))
