"""When a pass may carry proposals (core/verification.py places them, core/spec_sizing.py
sizes them): only when no prompt is in line for its first token.

A proposal always lengthens the pass it rides in, and a prompt's chunk in that pass reaches
its first token only when the pass ends: any proposal beside a prompt in line delays that
prompt's first token by what it costs. (Letting proposals fill the time a TPOT target leaves
after the prompts' reserve is not enough: the pass grows from its decodes plus the prefill to
the whole target.) So speculation yields the
pass whenever the prefill could move: a running sequence still in its prompt, or a queued
one (swapped, preempted or waiting) with a seat free to take. Once the prompts are through,
the sizing rule's rate alone decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from everystop.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from everystop.core.scheduler_state import SchedulerState as Scheduler


def prompt_in_line(sched: Scheduler, prefilling: Iterable[Request]) -> bool:
    """Whether a prompt could get prefill this pass: a running row of `prefilling` with
    prompt left, or a queued request while a seat is free."""
    if any(req.status is RequestStatus.RUNNING and req.num_tokens > req.num_computed_tokens
           for req in prefilling):
        return True
    if sched.num_seats <= len(sched.running):
        return False
    return bool(sched.swapped or sched.preempted or sched.waiting)
