"""Turns the scheduler's per-request token updates into text deltas, and ends requests on stop
strings (which only show up once tokens are text)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from everystop.core.outputs import RequestMetrics, RequestOutput, RequestUpdate, TokenLogprob
from everystop.core.request import Request
from everystop.sampling_params import SamplingParams


class Detokenizer(Protocol):
    def push(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text they completed (may hold back partial chars)."""


@dataclass
class _RequestState:
    request: Request
    detok: Detokenizer
    params: SamplingParams
    text: str = ""
    emitted_chars: int = 0  # how much of `text` consumers have been given
    token_ids: list[int] = field(default_factory=list)
    emitted_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    stop_hold: int = 0  # chars held back: a suffix that may be the start of a stop string
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


class OutputProcessor:
    def __init__(self, detokenizer_factory: Callable[[SamplingParams], Detokenizer],
                 clock: Callable[[], float]) -> None:
        self._new_detok = detokenizer_factory
        self._clock = clock
        self._states: dict[str, _RequestState] = {}

    def add(self, req: Request) -> None:
        params = req.sampling_params
        hold = max((len(s) for s in params.stop), default=1) - 1
        self._states[req.request_id] = _RequestState(req, self._new_detok(params), params,
                                                    stop_hold=hold)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to deliver, and ids of requests a stop string has just ended
        (the engine tells the scheduler to free them)."""
        outputs, stopped = [], []
        for upd in updates:
            state = self._states.get(upd.request_id)
            if state is None:
                continue
            finish_reason = None
            # NOTE: a speculating row delivers several tokens at once; with stop strings they
            # are taken one at a time, so a stop string ends the output at the token that
            # completes it, as in plain decoding (the tokens after it are dropped).
            parts = (_one_token_parts(upd) if state.params.stop and len(upd.new_token_ids) > 1
                     else [upd])
            for part in parts:
                finish_reason, ended_by_stop = self._apply(state, part)
                if ended_by_stop:
                    stopped.append(upd.request_id)
                if finish_reason is not None:
                    break
            outputs.append(self._emit(state, finish_reason))
        return outputs, stopped

    def _apply(self, state: _RequestState, upd: RequestUpdate) -> tuple[str | None, bool]:
        """Add one update's tokens and text; return its finish reason, and whether a stop
        string has just ended a request the scheduler still runs."""
        finish_reason = upd.finish_reason
        ended_by_stop = False
        state.token_ids.extend(upd.new_token_ids)
        state.logprobs.extend(upd.new_logprobs)
        if upd.prompt_logprobs is not None:
            state.prompt_logprobs = upd.prompt_logprobs
        # An EOS or stop token ends the text without appearing in it, unless the request
        # asks for its stop string (vLLM's include_stop_str_in_output; a special token,
        # EOS, is then still dropped by the detokenizer's skip_special_tokens).
        keep_stop = state.params.include_stop_str_in_output
        text_ids = (upd.new_token_ids[:-1] if upd.stop_token_id is not None and not keep_stop
                    else upd.new_token_ids)
        if upd.stop_token_id is not None and upd.stop_token_id in state.params.stop_token_ids:
            state.stop_reason = upd.stop_token_id  # EOS leaves it None, as vLLM does
        if text_ids:
            state.text += state.detok.push(text_ids)
        if finish_reason is not None and hasattr(state.detok, "flush"):
            state.text += state.detok.flush()  # bytes held back for a char that never ended
        if state.params.stop and finish_reason != "abort":
            cut = self._find_stop(state)
            if cut is not None:
                state.text = state.text[:cut]
                ended_by_stop = finish_reason is None
                finish_reason = "stop"
        return finish_reason, ended_by_stop

    def _find_stop(self, state: _RequestState) -> int | None:
        """Index where the text should end if a stop string has appeared, else None."""
        # Only the part not yet emitted (plus the held-back tail) can contain a new match.
        search_from = max(0, state.emitted_chars - state.stop_hold)
        best = None
        for stop in state.params.stop:
            i = state.text.find(stop, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        start, state.stop_reason = best
        return start + len(best[1]) if state.params.include_stop_str_in_output else start

    def _emit(self, state: _RequestState, finish_reason: str | None) -> RequestOutput:
        finished = finish_reason is not None
        safe = len(state.text) if finished else max(state.emitted_chars,
                                                      len(state.text) - state.stop_hold)
        new_text = state.text[state.emitted_chars:safe]
        state.emitted_chars = safe
        new_tokens = state.token_ids[state.emitted_tokens:]
        new_logprobs = state.logprobs[state.emitted_tokens:]
        state.emitted_tokens = len(state.token_ids)
        req = state.request
        out = RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            new_token_ids=new_tokens, new_text=new_text, token_ids=list(state.token_ids),
            text=state.text[:safe], finished=finished, finish_reason=finish_reason,
            num_cached_tokens=max(0, req.num_cached_tokens), new_logprobs=new_logprobs,
            metrics=RequestMetrics(req.arrival_time, req.admitted_time, req.first_token_time,
                                   req.finished_time or (self._clock() if finished else None),
                                   req.preemption_count),
            logprobs=list(state.logprobs), prompt_logprobs=state.prompt_logprobs,
            stop_reason=state.stop_reason if finish_reason == "stop" else None)
        if finished:
            del self._states[req.request_id]
        return out

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self._states.get(request_id)
        if state is None:
            return None
        return self._emit(state, "abort")


def _one_token_parts(upd: RequestUpdate) -> list[RequestUpdate]:
    """A multi-token update as one update per token; the last carries how it ended."""
    ids, lps = upd.new_token_ids, upd.new_logprobs
    parts = [RequestUpdate(upd.request_id, [t], lps[i:i + 1]) for i, t in enumerate(ids)]
    last = parts[-1]
    last.finish_reason, last.stop_token_id = upd.finish_reason, upd.stop_token_id
    parts[0].prompt_logprobs = upd.prompt_logprobs
    return parts
