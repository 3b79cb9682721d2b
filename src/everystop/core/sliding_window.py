"""Which KV blocks a sliding-window model can still read: the arithmetic by which the cache
manager releases blocks while a sequence runs.

A query at position p attends to positions p-W+1 .. p (W = the window, in every layer). A pass
whose first query is at position s, and every later pass of the sequence, therefore never reads
a logical block lying wholly before s-W+1::

    logical block    0       1       2       3       4
                   |-------|-------|-------|-------|---...
                   |<-- released -->|   |<--- window of s --->|
                                        ^ s-W+1               ^ s

The released blocks always form a leading run of the table, growing as s moves right.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlidingWindow:
    """A window of `window` tokens over blocks of `block_size` tokens."""

    window: int
    block_size: int

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise ValueError(f"a sliding window must be > 0 tokens, not {self.window}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, not {self.block_size}")

    def first_live_block(self, next_pos: int) -> int:
        """The first logical block a query at `next_pos` or later may read: those before it
        can be released."""
        return max(0, (next_pos - self.window + 1) // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_pass_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens holds at once when no pass
        carries more than `max_pass_tokens` of it: a pass at s..s+n-1 reads s-W+1 .. s+n-1,
        W+n-1 positions, which straddle at most one block more than they fill."""
        bs = self.block_size
        full = -(-num_tokens // bs)
        span = self.window - 1 + min(max_pass_tokens, num_tokens)
        return min(full, -(-span // bs) + 1)

    def longest_hit(self, cached: list[bool]) -> int:
        """How many leading blocks a new sequence may adopt as computed, given which of its
        full blocks the prefix cache holds (`cached[i]`, each checked against the sequence's
        own hash chain): the largest L whose blocks first_live_block(L * block_size) .. L-1
        are all cached. The blocks before those are never read again, so need not be there."""
        best = run = 0
        bs = self.block_size
        for i, hit in enumerate(cached):
            run = run + 1 if hit else 0
            end = i + 1
            if run and run >= end - self.first_live_block(end * bs):
                best = end
        return best
