"""After a forward pass raised (for a reason other than memory): find the request or requests
that make it fail by running the pass's rows again in halves, so that only they fail and their
batch-mates keep the tokens they would have had.

    pass [a b c d e f g h] raised
      [a b c d] ran     -> its results are kept
      [e f g h] raised  -> halved again
        [e f] ran,  [g h] raised
          [g] ran,  [h] raised -> h fails, alone

A re-run writes exactly the K/V its rows' positions would have had (core/failed_pass.py: the
scheduler's state is untouched until the results are applied), so a row's one successful run
leaves its cache as a clean pass would. Each halving costs two passes; the search stops after
`max_culprits` culprits' worth (2 * ceil(log2 n) passes each), and every row it has not cleared
by then fails with the pass's error: a fault that hits every pass costs a bounded delay.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from everystop.core.failed_pass import with_rows
from everystop.core.outputs import ModelOutput, ScheduledSequence, SchedulerOutput

logger = logging.getLogger("everystop.engine")

MAX_CULPRITS = 3


@dataclass
class Isolated:
    """What the search leaves to apply: the pass of the rows that ran (in the failed pass's
    order), their merged results, with the culprits and the rows beyond the cap in `failed`."""

    sched: SchedulerOutput
    result: ModelOutput
    num_passes: int


def forward_error(exc: BaseException) -> str:
    """The reason a request failed by a forward pass is given (the server shows it)."""
    return f"engine error in the forward pass: {type(exc).__name__}: {exc}"


def search_budget(num_rows: int, max_culprits: int = MAX_CULPRITS) -> int:
    """Extra passes the search may run for a failed pass of `num_rows` rows."""
    return max_culprits * 2 * math.ceil(math.log2(num_rows)) if num_rows > 1 else 0


def isolate_faults(execute: Callable[[SchedulerOutput], ModelOutput], failed: SchedulerOutput,
                   error: BaseException, check_health: Callable[[], None], *,
                   changed: bool = False, max_culprits: int = MAX_CULPRITS) -> Isolated:
    """Run `failed`'s rows again in halves until the rows that raise are alone (see the module
    docstring). `failed` has no swap copies (core/failed_pass.recompute_swapped); `changed`:
    it is not the pass that raised (copies or rows were dropped), so it is first run whole.
    Padding rows are left out: they compute nothing anyone reads. `check_health` raises if
    the executor itself has died, which no search can fix."""
    rows = [e for e in failed.scheduled if not e.padding]
    result, cleared = ModelOutput(), set[str]()

    def run(part: list[ScheduledSequence]) -> BaseException | None:
        """Run `part` alone: None and its results kept, or what it raised."""
        try:
            out = execute(with_rows(failed, part))
        except Exception as exc:
            check_health()
            return exc
        _merge(result, out)
        cleared.update(e.request_id for e in part)
        return None

    num_passes = int(changed and bool(rows))
    first = run(rows) if num_passes else error
    suspects = [(rows, first)] if rows and first is not None else []
    budget = num_passes + search_budget(len(rows), max_culprits)
    while suspects:
        group, exc = suspects.pop()
        if len(group) == 1:
            result.failed[group[0].request_id] = forward_error(exc)
        elif num_passes + 2 > budget:  # the cap: everything not cleared fails
            for left, why in [(group, exc), *suspects]:
                result.failed.update((e.request_id, forward_error(why)) for e in left)
            break
        else:
            half = len(group) // 2
            for part in (group[:half], group[half:]):
                num_passes += 1
                part_exc = run(part)
                if part_exc is not None:
                    suspects.append((part, part_exc))
    logger.error("forward pass of %d sequences failed; %d passes of some of them then failed "
                 "%d and ran %d", len(rows), num_passes, len(result.failed), len(cleared),
                 exc_info=error)
    ran = [e for e in rows if e.request_id in cleared]
    return Isolated(with_rows(failed, ran), result, num_passes)


def _merge(into: ModelOutput, out: ModelOutput) -> None:
    """Fold one re-run's results in. The time stays 0: the re-runs together are no pass the
    step-cost fit should learn from."""
    into.sampled_token_ids.update(out.sampled_token_ids)
    into.verified_token_ids.update(out.verified_token_ids)
    into.verified_logprobs.update(out.verified_logprobs)
    into.logprobs.update(out.logprobs)
    into.prompt_logprobs.update(out.prompt_logprobs)
    into.failed.update(out.failed)
