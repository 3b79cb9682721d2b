"""What the scheduler's helper modules (static batching, failed passes, out-of-memory backoff,
inspection) read and call on the `Scheduler`: its queues and pool, and the admission and
preemption steps it owns. They type against this rather than the class, so that the scheduler
imports them and none of them imports it back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from everystop.config import SchedulerConfig
from everystop.core.arrival_rate import ArrivalRate
from everystop.core.intake import QueuedCounts
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.pass_builder import PassBuilder
from everystop.core.request import Request, RequestStatus
from everystop.core.request_queue import RequestQueue
from everystop.core.spec_sizing import SpecSizer
from everystop.core.speculation import DraftCheck, Proposer
from everystop.core.step_cost import StepCostModel


class SchedulerState(Protocol):
    config: SchedulerConfig
    kv: KVCacheManager
    clock: Callable[[], float]
    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue
    preempted: RequestQueue
    swapped: RequestQueue
    num_preemptions: dict[str, int]
    num_swap_out_blocks: int
    num_swap_in_blocks: int
    num_drafts: int  # speculating rows verified; the proposals they carried, and accepted
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]  # [i]: rows that kept their proposal i (0-based)
    proposer: Proposer | None
    draft_check: DraftCheck | None  # cuts structured-output proposals at their grammar
    spec_sizer: SpecSizer
    arrivals: ArrivalRate  # the recent arrival rate (core/arrival_rate.py)
    last_prefill_budget_tokens: int
    step_cost: StepCostModel
    auto_tpot_target_s: float
    serves_lora: bool

    @property
    def num_seats(self) -> int: ...

    @property
    def padding_lag(self) -> int: ...

    @property
    def queued_counts(self) -> QueuedCounts: ...

    @property
    def padding_rows(self) -> list[Request]: ...

    def grow(self, req: Request, n: int, step: PassBuilder) -> bool: ...

    def emit(self, step: PassBuilder, req: Request, n: int) -> None: ...

    def start_running(self, req: Request, computed: list, step: PassBuilder) -> None: ...

    def leave_running(self, req: Request) -> None: ...

    def recompute_later(self, victim: Request) -> None: ...

    def finish(self, req: Request, status: RequestStatus) -> None: ...
