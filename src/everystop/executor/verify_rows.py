"""A speculating row's 1+k sampled positions, each as the sampler must see it.

Position j of a row with proposals d1..dk samples the token at output index i+j (i: the row's
own), after d1..dj have been appended. So each position gets its own view: the output index
that min_tokens and the seeded random stream (seed, output index) read, and the tokens seen
so far that penalties and bad words read, and its own structured-output mask (the row carries
one per position, engine/structured_output.py). Sampling each position from the distribution it
would have in plain decoding, and keeping the proposals while they equal those samples, is
the rejection rule for a point-mass proposal (executor/rejection_sampler.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from everystop.core.outputs import ScheduledSequence


def per_position_rows(sampled: Sequence[ScheduledSequence]) -> list[ScheduledSequence]:
    """`sampled` (one entry per sampled row: a speculating sequence repeated 1+k times, in
    order) with each repeat after the first replaced by its position's view. Plain rows pass
    through as they are."""
    rows: list[ScheduledSequence] = []
    prev: ScheduledSequence | None = None
    j = 0
    for seq in sampled:
        j = j + 1 if seq is prev else 0
        prev = seq
        if not seq.num_draft_tokens:
            rows.append(seq)
            continue
        mask = None if seq.token_bitmask is None else seq.token_bitmask[j]
        if j == 0:
            rows.append(seq if mask is None else dataclasses.replace(seq, token_bitmask=mask))
            continue
        drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens:][:j]
        seen = seq.output_token_ids
        rows.append(dataclasses.replace(
            seq, output_index=seq.output_index + j, token_bitmask=mask,
            output_token_ids=None if seen is None else list(seen) + drafts))
    return rows
