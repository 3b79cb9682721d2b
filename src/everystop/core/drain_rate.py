"""How fast a queue drains: requests leaving it (admitted or aborted) per second, smoothed.

A refused client is told to come back when the queue that refused it should have room: its
depth over this rate (`wait_for`), the Retry-After of a 429.

The meter keeps an exponentially decaying count of departures (time constant TAU_S). For a queue
that has drained at a steady r per second since the meter was made, that count is
r * TAU_S * (1 - exp(-age / TAU_S)), so dividing by the bracket gives r back, young or old; a
queue that stops moving sees its rate decay towards zero, and its wait grow.
"""

from __future__ import annotations

import math

TAU_S = 10.0  # how far back the rate looks (a departure 10 s ago weighs 1/e of one now)
MIN_AGE_S = 1.0  # a meter younger than this is judged as if it were this old: a burst of
# admissions in one step is not a rate of thousands per second


class DrainMeter:
    """Departures from one queue. Written by the scheduler's thread, read from any: the state
    is one tuple, replaced whole."""

    __slots__ = ("_state",)

    def __init__(self, now: float) -> None:
        self._state = (now, now, 0.0)  # (made at, last departure, decayed departure count)

    def leave(self, now: float, n: int = 1) -> None:
        born, last, weight = self._state
        self._state = (born, now, weight * math.exp(-(now - last) / TAU_S) + n)

    def rate(self, now: float) -> float | None:
        """Departures per second; None when nothing has left this queue yet."""
        born, last, weight = self._state
        if weight == 0.0:
            return None
        decayed = weight * math.exp(-max(0.0, now - last) / TAU_S)
        age = max(now - born, MIN_AGE_S)
        return decayed / (TAU_S * -math.expm1(-age / TAU_S))


def wait_for(depth: int, meters: list[DrainMeter | None], now: float) -> float:
    """Seconds until `depth` requests have left the queue at its measured rate: the first of
    `meters` that has seen a departure is used (the queue's own, then broader ones). inf when
    none has: a queue never seen to move gives no reason to expect it soon."""
    for meter in meters:
        rate = None if meter is None else meter.rate(now)
        if rate:
            return depth / rate
    return math.inf
