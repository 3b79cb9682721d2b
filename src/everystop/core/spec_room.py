"""What a pass's proposals may spend (core/verification.py places them, core/spec_sizing.py
sizes them): the tokens and step time the prompts waiting for their first token leave.

Proposals are counted after the plain decodes and before prefill chunks, but a prompt's first
token comes first: the prefill the pass could give the prompts in line (those mid-prompt, then
the queued ones up to the free seats, at most one chunk each) is reserved before any proposal.
Proposals get the tokens left under max_num_batched_tokens after that reserve and, where the
pass has a TPOT target, the predicted time left under the target after the reserve's cost:
with prompts enough to fill the pass, none. With no prompt waiting, the sizing rule's rate
alone decides (a pass's tokens per second is its rows' mean time per token, inverted).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from everystop.core.request import Request, RequestStatus
from everystop.core.step_budget import StepBudget

if TYPE_CHECKING:
    from everystop.core.scheduler_state import SchedulerState as Scheduler


def prefill_reserve(sched: Scheduler, prefilling: Iterable[Request], cap: int) -> int:
    """Prefill tokens (at most `cap`) the prompts in line could take this pass."""
    cfg = sched.config
    chunk = cfg.chunk_size if cfg.enable_chunked_prefill else cap
    total = 0
    for req in prefilling:
        if req.status is RequestStatus.RUNNING:
            total += min(req.num_tokens - req.num_computed_tokens, chunk)
    seats = sched.num_seats - len(sched.running)
    for queue in (sched.swapped, sched.preempted, sched.waiting):
        for req in queue:
            if seats <= 0 or total >= cap:
                return min(total, cap)
            total += min(req.num_tokens - req.num_computed_tokens, chunk)
            seats -= 1
    return min(total, cap)


def proposal_room(budget: StepBudget, reserve: int) -> tuple[int, float]:
    """The tokens proposals may take and the predicted seconds (pass and draft passes) they
    may bring the pass to, with `reserve` prefill tokens kept for the prompts in line."""
    tokens = budget.tokens_left - reserve
    coeffs = budget.coeffs
    if not reserve or coeffs is None or budget.target_s is None:
        return tokens, math.inf
    return tokens, budget.target_s - reserve * (coeffs.prefill_token + coeffs.context_token)
