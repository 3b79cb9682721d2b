"""Prompt logprobs from a prefill pass: for the requests that ask (prompt_logprobs, or echo
with logprobs on the server), the log-probability of each prompt token given its prefix.

A prefill chunk runs positions start .. start+n-1; the hidden state at position p predicts token
p+1, so it scores prompt token p+1 while p+1 is still in the prompt::

    prompt   t0   t1   t2   t3   t4        (t0 has no prefix: no logprob)
    chunk        [p1   p2   p3]            -> scores t2, t3, t4

Only these rows go through the LM head besides the sampled ones; a pass where no request asks
builds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from everystop.core.outputs import ScheduledSequence, TokenLogprob


@dataclass
class PromptLogprobPlan:
    rows: torch.Tensor  # [M] rows of the packed hidden states to score
    targets: torch.Tensor  # [M] the prompt token each row scores
    spans: list[tuple[str, int, int, int]]  # (request id, first row, rows, top-k)


def plan_prompt_logprobs(seqs: Sequence[ScheduledSequence], query_start_loc: Sequence[int],
                         device: torch.device) -> PromptLogprobPlan | None:
    """The rows to score in this pass, or None when no scheduled prefill asks."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[str, int, int, int]] = []
    for i, s in enumerate(seqs):
        k = s.sampling_params.prompt_logprobs
        prompt = s.prompt_token_ids
        if k is None or prompt is None or s.padding:
            continue
        n = min(s.start_pos + s.num_tokens, len(prompt) - 1) - s.start_pos
        if n <= 0:
            continue
        spans.append((s.request_id, len(rows), n, k))
        rows.extend(range(query_start_loc[i], query_start_loc[i] + n))
        targets.extend(prompt[s.start_pos + 1:s.start_pos + 1 + n])
    if not rows:
        return None
    return PromptLogprobPlan(torch.tensor(rows, device=device),
                             torch.tensor(targets, device=device), spans)


def score(logits: torch.Tensor, plan: PromptLogprobPlan) -> dict[str, list[TokenLogprob]]:
    """logits: [M, vocab], one row per planned row -> each request's entries, in order."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, plan.targets[:, None]).squeeze(-1).tolist()
    k = max(span[3] for span in plan.spans)
    top_vals, top_ids = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
    vals, ids, targets = top_vals.tolist(), top_ids.tolist(), plan.targets.tolist()
    out: dict[str, list[TokenLogprob]] = {}
    for rid, first, n, want in plan.spans:
        out[rid] = [TokenLogprob(targets[r], chosen[r], list(zip(ids[r][:want], vals[r][:want])))
                    for r in range(first, first + n)]
    return out
