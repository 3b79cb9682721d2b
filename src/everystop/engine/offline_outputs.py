"""The offline `LLM` API's results in vLLM's shapes, so code written against vLLM's
`RequestOutput` / `CompletionOutput` reads them unchanged: `logprobs` as one
{token id: Logprob} dict per generated token, `cumulative_logprob`, `stop_reason`, and
`prompt_logprobs` with one entry per prompt token, the first None."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from everystop.core.outputs import RequestMetrics, RequestOutput, TokenLogprob


@dataclass
class Logprob:
    """vLLM's per-token entry: the logprob, its rank (1 = the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the `n` completions of a prompt. `logprobs` is None unless asked for;
    `stop_reason` is the stop string or stop token id that ended it (None for EOS or length)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class LLMOutput:
    """One prompt's result (vLLM's `RequestOutput`): its n completions in `outputs`. `text`,
    `token_ids` and `finish_reason` are the first completion's, for the common n = 1."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


Decode = Callable[[int], str]


def llm_output(prompt: str | None, completions: Sequence[RequestOutput], wants_logprobs: bool,
               decode: Decode) -> LLMOutput:
    """`completions` (one prompt's n finished engine outputs) in vLLM's shapes."""
    first = completions[0]
    outputs = []
    for index, out in enumerate(completions):
        logprobs = [_entry(lp, decode) for lp in out.logprobs] if wants_logprobs else None
        cumulative = sum(lp.logprob for lp in out.logprobs) if wants_logprobs else None
        outputs.append(CompletionOutput(index, out.text, out.token_ids, cumulative, logprobs,
                                        out.finish_reason, out.stop_reason))
    scored = None
    if first.prompt_logprobs is not None:
        scored = [None, *(_entry(lp, decode) for lp in first.prompt_logprobs)]
    return LLMOutput(first.request_id, prompt, first.prompt_token_ids, scored, outputs,
                     metrics=first.metrics, num_cached_tokens=first.num_cached_tokens,
                     errors=[o.error for o in completions if o.error])


def _entry(lp: TokenLogprob, decode: Decode) -> dict[int, Logprob]:
    """The chosen token and the top alternatives, ranked as vLLM ranks them: by logprob, ties
    sharing the better rank; the chosen token's rank counts the tokens above it."""
    entry = {tid: Logprob(value, rank, decode(tid))
             for rank, (tid, value) in enumerate(lp.top, start=1)}
    if lp.token_id not in entry:
        above = sum(1 for _, value in lp.top if value > lp.logprob)
        entry = {lp.token_id: Logprob(lp.logprob, above + 1, decode(lp.token_id)), **entry}
    return entry
