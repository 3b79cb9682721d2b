"""How many bytes of weights one forward pass reads, counted as the pass runs.

A pass reads most weights whole (attention, norms, routers, dense MLPs, the LM head once per
call for logits); the embedding only the rows of its tokens; a sparse MoE block only the
experts its rows chose. The whole weights' bytes are known without running anything, so the
pass records only what varies: its token count, whether logits were computed, and the bytes
of the weight slices the partly-read layers read. Plain integers, added per layer per pass:
no tensor is read or synchronized to count.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class WeightReads:
    """The varying part of the last pass's weight reads (see the module docstring)."""

    __slots__ = ("logits_computed", "partial_bytes", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.partial_bytes = 0
        self.logits_computed = False

    def begin(self, tokens: int) -> None:
        """A new pass over `tokens` tokens starts: forget the last one."""
        self.tokens = tokens
        self.partial_bytes = 0
        self.logits_computed = False

    def add_partial(self, nbytes: int) -> None:
        """A partly-read layer read `nbytes` bytes of its weights (e.g. its chosen experts)."""
        self.partial_bytes += nbytes

    def mark_logits(self) -> None:
        """The pass's hidden rows went through the LM head."""
        self.logits_computed = True


def pass_bytes(reads: WeightReads, weights: Iterable[torch.Tensor],
               partly_read: Iterable[torch.Tensor], embedding: torch.Tensor,
               head: torch.Tensor) -> int:
    """The bytes of weights the pass recorded in `reads` read: every tensor of `weights`
    whole, except those `partly_read` (counted as the layers reported them), the `embedding`
    ([vocab rows, ...] as held: one row per token) and the LM `head` (whole, when logits
    were computed; it may be the embedding itself, tied)."""
    skip = {id(w) for w in partly_read} | {id(embedding), id(head)}
    whole = sum(w.nbytes for w in weights if id(w) not in skip)
    row = embedding.nbytes // embedding.shape[0] if embedding.shape[0] else 0
    return (whole + reads.tokens * row + reads.partial_bytes
            + (head.nbytes if reads.logits_computed else 0))
