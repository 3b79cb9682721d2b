"""How the decode rows at the head of `running` join a pass: `Scheduler.decode_batch`, the one
seam through which a caller may hold them in bulk.

The scheduler walks its running rows one by one, and the engine leaves it so (`EAGER_DECODES`,
the default, holds nothing). A caller that already knows those rows' next passes - the fleet
simulator's decode stretch (sim/decode_stretch.py), where every one decodes a token per pass -
may hold the first rows of `running` itself, as a `DecodeBatch`, and apply their tokens many
passes at a time. The scheduler calls it at two points, and nowhere else:

    begin_pass(step)   step 1's start: the held rows grow and are budgeted, in running order, as
                       the scheduler's own decode loop would (`add_held_rows`); the scheduler
                       then walks only the rows after them
    give_back(step)    before a preemption ranks the running rows: they are brought up to date
                       and, if the pass had begun, emitted as its first decode rows
                       (`emit_given_back`); the scheduler holds them from then on

      running:  [ held by the batch ........ | the scheduler's own rows ............ ]
      the pass: counted in num_bulk_decodes    in `scheduled` (decodes, then prefills)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from everystop.core.pass_builder import PassBuilder
from everystop.core.request import Request


class DecodeBatch(Protocol):
    """Decode rows a caller holds in bulk: the first rows of `running`, in its order, each
    decoding one token per pass, their tokens brought up to date only when given back."""

    # Speculation proposes on every decode row of a pass one by one: it waits while rows are held.
    holds_rows: bool

    def begin_pass(self, step: PassBuilder) -> int:
        """At step 1's start: grow the rows' blocks and budget them (`add_held_rows`); how many
        leading rows of `running` that covers (0: it gave them back instead, e.g. the pool is
        short for their growth, and installed `EAGER_DECODES` again)."""
        ...

    def give_back(self, step: PassBuilder) -> None:
        """Bring the rows up to date; if this pass had begun, emit them first in `step`'s
        decodes (`emit_given_back`). The scheduler has taken the seam back already."""
        ...


class EagerDecodes:
    """The engine's: every decode row is the scheduler's own, visited one by one."""

    holds_rows = False

    def begin_pass(self, step: PassBuilder) -> int:
        return 0

    def give_back(self, step: PassBuilder) -> None:
        return None


EAGER_DECODES = EagerDecodes()


def add_held_rows(step: PassBuilder, start_positions: list[int], tiers: Iterable[int],
                  offset: int = 0) -> None:
    """Budget the held rows in this pass, as the decode loop would one by one (the same float
    sums, in the same order): their positions (plus `offset`, the passes since the positions
    were taken) and their tiers once each. The pass's shape counts them."""
    step.budget.add_decode_rows(start_positions, tiers, offset=offset)
    step.num_bulk = len(start_positions)
    step.bulk_context = sum(start_positions) + (offset + 1) * len(start_positions)


def emit_given_back(step: PassBuilder, rows: Iterable[Request],
                    block_ids: Callable[[str], list[int]]) -> None:
    """The held rows, brought up to date, as the first decode rows of a pass that budgeted them
    with `add_held_rows` (the order the decode loop would have emitted them in)."""
    others, step.decodes = step.decodes, {}
    for req in rows:
        step.emit(req, 1, block_ids(req.request_id), budgeted=True)
    step.decodes.update(others)
    step.num_bulk = step.bulk_context = 0
