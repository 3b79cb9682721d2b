"""Speculative decoding's proposal side: guess a running sequence's next tokens cheaply, so one
forward pass can verify several of them at once (the scheduler's pass, core/scheduler.py).

A `Proposer` only guesses; correctness never depends on it. The scheduler runs the sequence's
last token plus the k proposals as 1+k rows, the executor returns the model's token at each
row (greedy, or sampled exactly as plain decoding samples that position: seeds, penalties,
min_tokens, logit_bias and logprobs included, executor/verify_rows.py), and the proposals are
kept while they equal those tokens (core/verification.py); with sampling that is the
rejection rule for a point-mass proposal, so the output distribution is the target's. Stop
strings cut a pass's tokens where the text first holds one (engine/output_processor.py).

Which requests speculate: all but those that set disable_spec_decode. With structured output
a `DraftCheck` (the engine's grammar matcher, engine/structured_output.py) cuts the proposals
at the first token the grammar rejects, and each verified position samples under the grammar's
mask for the state after the proposals before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from everystop.core.request import Request
from everystop.sampling_params import SamplingParams

# Given a structured-output request and its proposals, the longest prefix its grammar accepts.
DraftCheck = Callable[[Request, list[int]], list[int]]


class Proposer(Protocol):
    """Proposes draft tokens for one running sequence."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens guessed to follow `token_ids` (prompt then output); [] for none."""
        ...


@runtime_checkable
class BatchProposer(Proposer, Protocol):
    """A proposer that drafts for many sequences at once more cheaply than one by one."""

    def propose_batch(self, contexts: Sequence[Sequence[int]], ks: Sequence[int]
                      ) -> list[list[int]]:
        """propose(contexts[i], ks[i]) for every i, in order."""
        ...


class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens earlier in its own tokens (the longest
    n from max_n down to min_n that matches) and propose the k tokens that followed the most
    recent earlier occurrence. Strong where the output copies its input (quotes, code edits,
    summaries with names), free otherwise."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        num = len(token_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            tail = list(token_ids[num - n:])
            first = tail[0]
            # The most recent earlier start i (i + n <= num - 1: not the tail itself) whose n
            # tokens equal the tail, searched right to left.
            for i in range(num - n - 1, -1, -1):
                if token_ids[i] == first and list(token_ids[i:i + n]) == tail:
                    return list(token_ids[i + n:min(i + n + k, num)])
        return []


def speculates(params: SamplingParams) -> bool:
    """Whether a request's next tokens may be verified k at a time: all but those that opt
    out (disable_spec_decode)."""
    return not params.disable_spec_decode


def make_proposer(method: str, min_n: int, max_n: int) -> Proposer | None:
    """The proposer a configuration names ('off': None). A draft model ('draft:PATH') is None
    here too: it needs the executor's machinery, and the engine attaches it
    (executor/draft_proposer.py)."""
    if method == "off" or method.startswith("draft:"):
        return None
    if method == "ngram":
        return NgramProposer(min_n, max_n)
    raise ValueError(f"unknown speculative method {method!r}")
