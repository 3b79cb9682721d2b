"""When a pass may carry proposals (core/verification.py places them, core/spec_sizing.py
sizes them): only when no prompt is in line for its first token, nor likely to arrive while
the pass runs.

A proposal always lengthens the pass it rides in, and a prompt's chunk in that pass reaches
its first token only when the pass ends: any proposal beside a prompt in line delays that
prompt's first token by what it costs. (Letting proposals fill the time a TPOT target leaves
after the prompts' reserve is not enough: the pass grows from its decodes plus the prefill to
the whole target.) So speculation yields the pass whenever the prefill could move: a running
sequence still in its prompt, or a queued one (swapped, preempted or waiting) with a seat free
to take.

A prompt that arrives while a pass runs waits for that pass to end before its own prefill
starts, so a pass's length matters while prompts are on their way too, not only once they are
queued: a burst of requests (32 clients starting at once) reaches the scheduler over tens of
milliseconds, and a long speculative pass started between two of its arrivals delays every
later one. The scheduler keeps the recent arrival rate (core/arrival_rate.py: each arrival counts
1 / ARRIVAL_MEMORY_S per second, decaying by e every ARRIVAL_MEMORY_S), and speculation also
yields a pass, while a seat is free, in which an arrival is more likely than not: rate times
the pass's predicted time (its decodes alone) of at least ln 2 expected arrivals. A lone
arrival does not stop it (1 / ARRIVAL_MEMORY_S times a pass well under ARRIVAL_MEMORY_S); a
burst does, until the rate has decayed some hundreds of milliseconds after its last arrival;
steady traffic does only where requests come faster than about one per pass.

Once the prompts are through and none is expected, the sizing rule's rate alone decides.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from everystop.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from everystop.core.scheduler_state import SchedulerState as Scheduler

ARRIVAL_LIKELY = math.log(2)  # expected arrivals in a pass at which one is more likely than not


def prompt_in_line(sched: Scheduler, prefilling: Iterable[Request]) -> bool:
    """Whether a prompt could get prefill this pass: a running row of `prefilling` with
    prompt left, or a queued request while a seat is free."""
    if any(req.status is RequestStatus.RUNNING and req.num_tokens > req.num_computed_tokens
           for req in prefilling):
        return True
    if sched.num_seats <= len(sched.running):
        return False
    return bool(sched.swapped or sched.preempted or sched.waiting)


def arrival_likely(sched: Scheduler, now: float, pass_s: float) -> bool:
    """Whether a prompt is more likely than not to arrive, with a seat free to take, during a
    pass of `pass_s` seconds starting at `now`."""
    if sched.num_seats <= len(sched.running):
        return False
    return sched.arrivals.expected(now, pass_s) >= ARRIVAL_LIKELY
