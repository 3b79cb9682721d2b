"""A request as the scheduler sees it: tokens, progress, priority and lifecycle state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from everystop.core.outputs import TokenLogprob
from everystop.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle. NOTE: everything after SWAPPED is finished (see `is_finished`)."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # KV dropped; waits to re-prefill prompt + generated tokens
    SWAPPED = 3  # KV held in host swap space; waits to be swapped back in
    FINISHED_STOPPED = 4  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 5  # max_tokens or max_model_len
    FINISHED_ABORTED = 6  # client went away, or the request was cancelled

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.SWAPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass(eq=False, slots=True)  # slots: read on every row of every pass (the hot path)
class Request:
    """One generation request.

    Token regions (num_computed_tokens moves right as forward passes run)::

        |<----------- prompt ----------->|<--- output --->|
        |<-- cached -->|<-- computed -->|  to compute ... |
        0         num_cached    num_computed_tokens    num_tokens
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 1  # 0 premium, 1 standard, 2 best-effort
    tenant: str = "default"
    # The LoRA adapter it runs with (the engine's id for it); -1: the base model.
    lora_id: int = -1
    lora_name: str | None = None  # the adapter's served name (metrics' label)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache at first admission (reported in usage).
    num_cached_tokens: int = -1
    # Scheduler bookkeeping.
    admitted_time: float | None = None  # first time it ran
    last_admitted_time: float | None = None  # most recent (re)admission, for victim choice
    first_token_time: float | None = None
    finished_time: float | None = None
    preemption_count: int = 0
    preemption_times: list[float] = field(default_factory=list)
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    # Logprobs of prompt tokens 1.. as prefill chunks score them (prompt_logprobs requests).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def keep_prompt_logprobs(self, start: int, scored: list[TokenLogprob]) -> None:
        """Append the part of a chunk's prompt logprobs not yet kept: entry k scores prompt
        token start + k + 1; a recomputed prefill (after preemption) repeats what is kept."""
        have = len(self.prompt_logprobs)
        if start <= have < start + len(scored):
            self.prompt_logprobs.extend(scored[have - start:])

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling_params.max_tokens
