"""Speculative sampling's acceptance rule, for any draft distribution: the output is a sample of
the target distribution whatever the draft proposes.

At each verified position with target distribution p and draft distribution q, the proposed
token x (drawn from q) is kept with probability min(1, p(x) / q(x)); on a rejection the token
is drawn from normalize(max(0, p - q)) and the rest of the proposals are dropped; when all k
are kept, one more token is drawn from the target's distribution after the last of them. Then
P(token = y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(q(x), p(x))) residual(y)
             = min(q(y), p(y)) + max(0, p(y) - q(y)) = p(y).

A point-mass q (the n-gram proposer: q(x) = 1) keeps x with probability p(x) and on a rejection
draws from p with x removed, which is what sampling x' from p and keeping x while x' == x does:
the form the engine uses (core/verification.py num_accepted), since it keeps each position's
token on the request's seeded stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_or_resample(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                       draft_tokens: torch.Tensor, generator: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One verified position for each of N rows.

    Args:
        target_probs, draft_probs: [N, V] distributions p and q (rows sum to 1).
        draft_tokens: [N] the proposed tokens (each with q > 0).
        generator: the random stream (seeded for reproducible output).
    Returns:
        (accepted [N] bool, tokens [N] long): the proposal where accepted, else a draw from
        normalize(max(0, p - q)).
    """
    rows = torch.arange(len(draft_tokens), device=target_probs.device)
    p_x = target_probs[rows, draft_tokens]
    q_x = draft_probs[rows, draft_tokens]
    uniform = torch.rand(len(draft_tokens), generator=generator, device=target_probs.device)
    # u < p/q, written without the division (q > 0 for a proposed token).
    accepted = uniform * q_x < p_x
    residual = (target_probs - draft_probs).clamp_min_(0.0)
    # p == q leaves no residual; a rejection then has probability 0, so any row works.
    empty = residual.sum(dim=-1) <= 0
    residual[empty] = target_probs[empty]
    resampled = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
    return accepted, torch.where(accepted, draft_tokens, resampled)


def rejection_sample(target_probs: torch.Tensor, draft_tokens: Sequence[int],
                     draft_probs: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """The tokens one speculating row adds: the kept proposals, then one drawn token.

    Args:
        target_probs: [k+1, V] the target's distribution after the row's last token and
            after each proposal.
        draft_tokens: the k proposals.
        draft_probs: [k, V] the draft's distribution each proposal was drawn from; None for a
            point mass on each proposal (a proposer with no distribution, e.g. n-gram).
        generator: the random stream.
    Returns:
        1 to k+1 tokens: drafts[:a] and then a token drawn from the residual (a < k) or from
        target_probs[k] (all k kept).
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} proposals need {k + 1} target rows, got {target_probs.shape[0]}")
    drafts = torch.tensor(list(draft_tokens), dtype=torch.long, device=target_probs.device)
    if draft_probs is None:
        draft_probs = torch.zeros_like(target_probs[:k])
        draft_probs[torch.arange(k), drafts] = 1.0
    out: list[int] = []
    for i in range(k):
        accepted, token = accept_or_resample(target_probs[i:i + 1], draft_probs[i:i + 1],
                                             drafts[i:i + 1], generator)
        out.append(int(token))
        if not bool(accepted):
            return out
    bonus = torch.multinomial(target_probs[k], 1, generator=generator)
    out.append(int(bonus))
    return out
