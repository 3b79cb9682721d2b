"""What an engine calls back on its own thread: after every step, and when a request finishes."""

from __future__ import annotations

from collections.abc import Callable

from everystop.core.outputs import IterationRecord, RequestOutput, SchedulerOutput
from everystop.core.request import Request

IterationListener = Callable[[IterationRecord, SchedulerOutput], None]
FinishListener = Callable[[Request, RequestOutput], None]
