"""The recent rate at which requests arrive: an exponentially decaying count, so a burst reads
as a high rate that fades once it stops (core/spec_room.py yields passes on it)."""

from __future__ import annotations

import math

ARRIVAL_MEMORY_S = 0.25  # how long an arrival counts in the rate (its e-folding time)


class ArrivalRate:
    """Requests arriving per second lately: an exponentially decaying count of arrivals over
    its memory (`memory_s`), so a burst reads as a high rate that fades once it stops."""

    def __init__(self, memory_s: float = ARRIVAL_MEMORY_S) -> None:
        if not memory_s > 0:
            raise ValueError(f"memory_s must be > 0, got {memory_s!r}")
        self.memory_s = memory_s
        self._rate = 0.0  # at time self._at
        self._at = -math.inf

    def note(self, at: float) -> None:
        """One arrival at time `at` (an arrival dated before the latest still counts, decayed
        by its age)."""
        if at >= self._at:
            self._rate = self.rate(at) + 1.0 / self.memory_s
            self._at = at
        else:
            self._rate += math.exp((at - self._at) / self.memory_s) / self.memory_s

    def rate(self, now: float) -> float:
        """Arrivals per second at `now`."""
        if self._rate == 0.0:
            return 0.0
        return self._rate * math.exp(-max(now - self._at, 0.0) / self.memory_s)

    def expected(self, now: float, span_s: float) -> float:
        """Arrivals expected in the `span_s` seconds from `now`, at the rate now."""
        return self.rate(now) * max(span_s, 0.0)
