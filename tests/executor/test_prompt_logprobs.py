"""Which packed rows score which prompt tokens, and their log-softmax (no model)."""

from __future__ import annotations

import torch

from everystop.core.outputs import ScheduledSequence
from everystop.executor.prompt_logprobs import plan_prompt_logprobs, score
from everystop.sampling_params import SamplingParams


def _seq(rid: str, prompt: list[int], start: int, n: int, k: int | None) -> ScheduledSequence:
    return ScheduledSequence(rid, prompt[start:start + n], start, [0, 1, 2, 3], True,
                             SamplingParams(prompt_logprobs=k), prompt_token_ids=prompt)


def test_rows_score_the_next_prompt_token_and_stop_at_the_prompt_end() -> None:
    prompt = [10, 11, 12, 13, 14, 15]
    seqs = [ScheduledSequence("decode", [7], 9, [0], True, SamplingParams()),  # not asking
            _seq("a", prompt, 0, 3, 2),  # positions 0-2 score tokens 1-3
            _seq("b", prompt, 3, 3, 0)]  # positions 3-5: 5 is the last, scores nothing
    plan = plan_prompt_logprobs(seqs, [0, 1, 4, 7], torch.device("cpu"))
    assert plan is not None
    assert plan.rows.tolist() == [1, 2, 3, 4, 5]
    assert plan.targets.tolist() == [11, 12, 13, 14, 15]
    assert plan.spans == [("a", 0, 3, 2), ("b", 3, 2, 0)]
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(0))
    out = score(logits, plan)
    ref = torch.log_softmax(logits, -1)
    got = [e.logprob for e in out["a"] + out["b"]]
    assert torch.allclose(torch.tensor(got), ref[torch.arange(5), plan.targets])
    assert [e.token_id for e in out["a"]] == [11, 12, 13]
    assert [t for t, _ in out["a"][0].top] == ref[0].topk(2).indices.tolist()
    assert out["b"][0].top == []


def test_nothing_is_planned_when_no_prefill_asks() -> None:
    seqs = [_seq("a", [1, 2, 3], 0, 3, None)]
    assert plan_prompt_logprobs(seqs, [0, 3], torch.device("cpu")) is None
