"""What the speculation sizing rule (core/spec_sizing.py) knows of each sequence: how often its
proposals are kept, and how much of it a draft model has been shown.

Acceptance. Each sequence has a running estimate of its per-position acceptance a (the chance
a proposal is kept, given the ones before it were): its accepted proposals A over its trials
A + R (R: the rows where a proposal was rejected), both decaying by SEQ_DECAY per verified row
so the estimate follows the text, shrunk toward the global rate g with PRIOR_WEIGHT trials:

    a = (A + PRIOR_WEIGHT * g) / (A + R + PRIOR_WEIGHT)

g is kept the same way over all rows (GLOBAL_DECAY), starting from INITIAL_ACCEPTANCE counted
as GLOBAL_PRIOR_WEIGHT trials.

What a draft model has seen. A draft model (executor/draft_proposer.py) holds K/V for the
tokens it was fed: a context it drafted for, then its own proposals but the last, fed back::

    drafted:   c1 .. cn  d1 .. d(k-1)          (dk is never fed)
    verified:  c1 .. cn  d1 .. da  g           (a kept, then the target's token)

so of the verified sequence it has seen n + min(a, k - 1) tokens, and its next pass feeds
only g (and dk as well when all k were kept). A sequence it has not drafted for since has
the tokens of those passes to feed too (its whole context, if never drafted).
"""

from __future__ import annotations

from dataclasses import dataclass

INITIAL_ACCEPTANCE = 0.6  # the global rate before any proposal was verified
PRIOR_WEIGHT = 2.0  # trials the global rate counts for in a sequence's estimate
GLOBAL_PRIOR_WEIGHT = 20.0  # trials INITIAL_ACCEPTANCE counts for in the global rate
SEQ_DECAY = 0.95  # per verified row: a sequence remembers about its last 20 rows
GLOBAL_DECAY = 0.999  # per verified row: the global rate, about the last 1,000 rows


@dataclass
class SeqState:
    accepted: float = 0.0
    trials: float = 0.0
    k: int = -1  # the last k chosen (-1: none yet)
    passes_off: int = 0  # consecutive passes sized to 0
    seen: int = 0  # tokens of the sequence a draft model holds K/V for (0: never shown it)


class AcceptanceEstimates:
    """Per-sequence acceptance estimates, the global rate, and what a draft model has seen."""

    def __init__(self, initial_acceptance: float = INITIAL_ACCEPTANCE) -> None:
        self._accepted = initial_acceptance * GLOBAL_PRIOR_WEIGHT
        self._trials = GLOBAL_PRIOR_WEIGHT
        self._seqs: dict[str, SeqState] = {}

    @property
    def global_acceptance(self) -> float:
        return self._accepted / self._trials

    def acceptance(self, request_id: str) -> float:
        """The sequence's per-position acceptance estimate (the global rate before any
        evidence of its own)."""
        g = self.global_acceptance
        s = self._seqs.get(request_id)
        if s is None:
            return g
        return (s.accepted + PRIOR_WEIGHT * g) / (s.trials + PRIOR_WEIGHT)

    def observe(self, request_id: str, num_proposals: int, num_accepted: int) -> None:
        """Fold in one verified row: `num_accepted` of its `num_proposals` were kept (by a
        draft model, if it drafted them: the ones it fed back count as seen)."""
        if num_proposals <= 0:
            return
        trials = num_accepted + (num_accepted < num_proposals)
        s = self._seqs.setdefault(request_id, SeqState())
        s.accepted = SEQ_DECAY * s.accepted + num_accepted
        s.trials = SEQ_DECAY * s.trials + trials
        self._accepted = GLOBAL_DECAY * self._accepted + num_accepted
        self._trials = GLOBAL_DECAY * self._trials + trials
        if s.seen:
            s.seen += min(num_accepted, num_proposals - 1)

    def forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)

    def drafted(self, request_id: str, num_tokens: int) -> None:
        """A draft model was shown the sequence's first `num_tokens` tokens, to propose after
        them."""
        self._seqs.setdefault(request_id, SeqState()).seen = num_tokens

    def unseen(self, request_id: str, num_tokens: int) -> int:
        """Of the sequence's `num_tokens` tokens, those a draft pass would feed: the ones the
        draft holds no K/V for (all, if never shown), at least the last."""
        s = self._seqs.get(request_id)
        return max(num_tokens - (s.seen if s is not None else 0), 1)
