"""Speculative sampling keeps the target's distribution: a toy target p over 8 tokens and a draft
q != p, 20,000 samples through the acceptance rule, chi-square goodness of fit against p; the
same test rejects deliberately wrong rules. Fixed seeds: the verdicts cannot flake."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from scipy.stats import chisquare

from everystop.core.verification import num_accepted
from everystop.executor.rejection_sampler import accept_or_resample, rejection_sample
from everystop.executor.sampler import Sampler
from everystop.sampling_params import SamplingParams

N = 20_000
P = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])  # the target's next token
Q = torch.tensor([0.05, 0.10, 0.30, 0.05, 0.25, 0.05, 0.10, 0.10])  # a draft that disagrees

Rule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor]


def p_value(tokens: torch.Tensor, p: torch.Tensor = P) -> float:
    counts = torch.bincount(tokens, minlength=len(p)).double()
    expected = p.double() / p.double().sum() * len(tokens)
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def through(rule: Rule, q: torch.Tensor, seed: int) -> torch.Tensor:
    """N outputs of one verified position: drafts drawn from q, then `rule`."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, N, replacement=True, generator=gen)
    return rule(P.expand(N, -1), q.expand(N, -1), drafts, gen)


def standard(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
             gen: torch.Generator) -> torch.Tensor:
    return accept_or_resample(p, q, drafts, gen)[1]


def always_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                  gen: torch.Generator) -> torch.Tensor:
    return drafts


def accept_with_q_over_p(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                         gen: torch.Generator) -> torch.Tensor:
    """The ratio upside down (the residual as the standard rule's)."""
    rows = torch.arange(len(drafts))
    keep = torch.rand(len(drafts), generator=gen) * p[rows, drafts] < q[rows, drafts]
    resampled = torch.multinomial((p - q).clamp_min(0), 1, generator=gen).squeeze(-1)
    return torch.where(keep, drafts, resampled)


def resample_from_p(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                    gen: torch.Generator) -> torch.Tensor:
    """The right acceptance, but a rejection redrawn from p itself, not the residual."""
    rows = torch.arange(len(drafts))
    keep = torch.rand(len(drafts), generator=gen) * q[rows, drafts] < p[rows, drafts]
    return torch.where(keep, drafts, torch.multinomial(p, 1, generator=gen).squeeze(-1))


def point_mass(token: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), len(P)).float()


@pytest.mark.parametrize("q", [Q, P, point_mass(0), point_mass(7)],
                         ids=["q-differs", "q-equals-p", "point-mass-likely", "point-mass-rare"])
def test_the_standard_rule_keeps_the_target_distribution(q: torch.Tensor) -> None:
    assert p_value(through(standard, q, seed=1)) > 0.01


@pytest.mark.parametrize("wrong", [always_accept, accept_with_q_over_p, resample_from_p])
def test_the_same_test_rejects_wrong_rules(wrong: Rule) -> None:
    assert p_value(through(wrong, Q, seed=1)) < 0.01


def test_a_point_mass_draft_through_the_engine_sampler_keeps_the_distribution() -> None:
    """What the engine does for an n-gram proposal d: each position's token is sampled from p
    (Sampler) and d is kept while it equals it (num_accepted). The first token a pass emits
    is then distributed as p, and d is kept with probability p(d)."""
    d = 1
    params = [SamplingParams(temperature=1.0)] * N
    sampled = Sampler("cpu", seed=3)(P.log().expand(N, -1).contiguous(), params, [0] * N)
    firsts, kept = [], 0
    for token in sampled.token_ids:
        accepted = num_accepted([d], [token, 0])  # the second token: after d, unused here
        kept += accepted
        firsts.append(d if accepted else token)
    assert p_value(torch.tensor(firsts)) > 0.01
    assert abs(kept / N - float(P[d])) < 4 * (float(P[d] * (1 - P[d])) / N) ** 0.5


def test_a_row_keeps_proposals_until_the_first_rejection_then_draws_one_token() -> None:
    gen = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    # p puts everything on the proposals: both kept, then the bonus token from the last row
    assert rejection_sample(target, [1, 2], None, gen) == [1, 2, 0]
    # the second proposal has p = 0: rejected, replaced by a draw from the residual (token 2)
    assert rejection_sample(target, [1, 0], None, gen) == [1, 2]
    # q puts all its mass where p has none: the first proposal goes, its residual is p
    q = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_sample(target, [0, 2], q, gen) == [1]
    with pytest.raises(ValueError, match="2 proposals need 3 target rows"):
        rejection_sample(target[:2], [1, 2], None, gen)


def test_a_seeded_stream_reproduces_the_same_tokens() -> None:
    target = torch.softmax(torch.randn(5, 8, generator=torch.Generator().manual_seed(2)), -1)
    runs = [rejection_sample(target, [3, 1, 4, 1], Q.expand(4, -1),
                             torch.Generator().manual_seed(11)) for _ in range(2)]
    assert runs[0] == runs[1]
