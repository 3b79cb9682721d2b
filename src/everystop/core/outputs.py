"""Plain data passed between the scheduler, the executor and the engine.

The contract: `Scheduler.schedule()` returns a `SchedulerOutput`; an executor consumes it and
returns a `ModelOutput`; `Scheduler.update_from_output()` applies that and returns one
`RequestUpdate` per request that produced tokens or finished. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from everystop.sampling_params import SamplingParams


@dataclass
class ScheduledSequence:
    """One sequence's share of the next forward pass.

    The executor runs `token_ids` at positions start_pos .. start_pos+len-1, writing their K/V
    into the slots given by `block_ids` (slot = block_ids[pos // block_size] * block_size +
    pos % block_size) and attending causally to every earlier position of the sequence through
    the same table. When `sample` is true it samples one next token from the last position.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    # Index of the token that will be sampled (= tokens generated so far); with a seed, the
    # sampler derives its random stream from (seed, output_index) so results do not depend on
    # batching or preemption.
    output_index: int = 0
    # Token history for repetition-style penalties and stop checks in the sampler (optional).
    is_prefill: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step (what attention covers for the last token)."""
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """The exact shape of the next forward pass. Decodes come first, then prefill chunks."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # Swap operations the executor performs before the forward pass (device<->host KV copies).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    # Requests that finished or were preempted since the previous step.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class ModelOutput:
    """What the executor produced: one sampled token per sequence that had `sample` set."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    execute_time_s: float = 0.0


@dataclass
class RequestUpdate:
    """The scheduler's verdict for one request after a step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    stop_token_id: int | None = None  # the EOS / stop token that ended it, if any

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
