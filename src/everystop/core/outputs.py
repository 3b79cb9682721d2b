"""Plain data passed between the scheduler, the executor and the engine.

The contract: `Scheduler.schedule()` returns a `SchedulerOutput`; an executor consumes it and
returns a `ModelOutput`; `Scheduler.update_from_output()` applies that and returns one
`RequestUpdate` per request that produced tokens or finished. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from everystop.sampling_params import SamplingParams


@dataclass(slots=True)  # slots: built and freed once per row per pass (the simulator's hot path)
class ScheduledSequence:
    """One sequence's share of the next forward pass.

    The executor runs `token_ids` at positions start_pos .. start_pos+len-1, writing their K/V
    into the slots given by `block_ids` (slot = block_ids[pos // block_size] * block_size +
    pos % block_size) and attending causally to every earlier position of the sequence through
    the same table. When `sample` is true it samples one next token from the last position.

    A speculating decode row (num_draft_tokens = k > 0) runs its last token plus k proposed
    tokens, and the executor returns the model's token at each of its 1+k positions
    (ModelOutput.verified_token_ids): the proposals are checked against them afterwards.
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
    is_prefill: bool = False
    # Static batching's padding: a finished member of a static batch keeps its seat until the
    # whole batch drains and is recomputed at its last position (compute only: no K/V write,
    # no sample), as a padded batch tensor would be.
    padding: bool = False
    # Set only for the requests whose parameters use them: the tokens seen so far (penalties,
    # and prompt logprobs, which score prompt token p+1 at position p; the request's own
    # lists, read before they grow) and the EOS id (min_tokens masks it until reached).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    eos_token_id: int | None = None
    # Structured output: the tokens this row may sample, a packed bitmask (bit t of 32-bit
    # word t // 32 set = token t allowed) filled by the engine before the pass; None: any.
    # A speculating row's holds one mask per verified position: [1 + num_draft_tokens, words].
    token_bitmask: Any = None
    # Speculative decoding: the trailing tokens of `token_ids` that are proposals, not yet
    # part of the request (0: a plain row).
    num_draft_tokens: int = 0
    # The LoRA adapter this row runs with (its engine-given id); -1: the base model.
    lora_id: int = -1

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
    swapped_in_request_ids: list[str] = field(default_factory=list)  # whose blocks come back
    # Requests that finished or were preempted since the previous step.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Decode-shaped rows, static padding rows included (they cost the same compute), and the
    # bulk ones below.
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_padding_tokens: int = 0
    # The step budget's view of this pass (core/step_budget.py): its predicted wall time, the
    # TPOT target it was built under (None: no target; stretched by TTFT aging, rule 5, by
    # tpot_stretch) and the prefill tokens the unstretched target left after the decodes.
    predicted_time_s: float = 0.0
    tpot_target_s: float | None = None
    tpot_stretch: float = 1.0
    prefill_budget_tokens: int = 0
    # Decode rows the pass runs that `scheduled` does not list: those a caller holds in bulk
    # (core/decode_batch.py: the fleet simulator's decode stretch); their count and the context
    # they read (positions + 1, summed). Always 0 in the engine.
    num_bulk_decodes: int = 0
    bulk_context_tokens: int = 0
    # Proposed tokens the speculating decode rows verify (each such row also counts one decode
    # token, its last real one).
    num_draft_tokens: int = 0
    # The LoRA adapters of every running request after this schedule (scheduled or not): the
    # executor keeps them in memory (--max-cpu-loras evicts others).
    running_lora_ids: frozenset[int] = frozenset()

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens + self.num_draft_tokens

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.num_bulk_decodes or self.blocks_to_swap_out
                    or self.blocks_to_swap_in)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class ModelOutput:
    """What the executor produced: one sampled token per sequence that had `sample` set."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Speculating rows (ScheduledSequence.num_draft_tokens = k): the model's token after each
    # of the row's last 1+k positions (greedy, or sampled as plain decoding would sample it).
    # A row missing here (an executor that does not verify) counts as not run, and turns
    # speculation off (core/verification.py).
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Their logprobs, one per position, for the requests that asked for logprobs.
    verified_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    execute_time_s: float = 0.0
    # Prefill rows of requests with prompt_logprobs: one entry per scheduled position p whose
    # next token p+1 is a prompt token (the entry scores that token), in position order.
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Sequences the pass could not produce a token for, with why (non-finite logits): the
    # engine ends them with an error; the rest of the batch goes on.
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)  # slots: one per sampled row per pass (the simulator's hot path)
class RequestUpdate:
    """The scheduler's verdict for one request after a step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    stop_token_id: int | None = None  # the EOS / stop token that ended it, if any
    # With the first output token: prompt tokens 1.. given their prefixes (prompt_logprobs).
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    admitted_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    preemption_count: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_wait_s(self) -> float | None:
        if self.admitted_time is None:
            return None
        return self.admitted_time - self.arrival_time


@dataclass
class RequestOutput:
    """What a consumer receives after each step that gave its request new tokens (or ended it).

    `new_text` / `new_token_ids` / `new_logprobs` are this step's delta; `text` / `token_ids` /
    `logprobs` are cumulative. Text that might be the start of a stop string is held back until
    it is known not to be. (The offline `LLM` API hands out engine/offline_outputs.py's
    vLLM-shaped view of these.)
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Prompt tokens 1.. given their prefixes (token 0 has none); None unless asked for.
    prompt_logprobs: list[TokenLogprob] | None = None
    # The stop string or stop token id that ended it (None for EOS, length, abort).
    stop_reason: int | str | None = None
    # With finish_reason "error": what went wrong (an engine fault, not the request's doing).
    error: str | None = None


@dataclass
class SchedulerStats:
    """The scheduler's state and counters, read by /metrics and the engine's stats."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_used_blocks: int
    num_total_blocks: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    swap_out_blocks: int
    swap_in_blocks: int
    # The step budget: prefill tokens the last pass's target left after its decodes, the
    # step-cost coefficients (seconds per feature unit), the last measured pass against its
    # prediction, and the TPOT target used where none is configured.
    prefill_budget_tokens: int = 0
    step_cost: dict[str, float] = field(default_factory=dict)
    step_predicted_s: float = 0.0
    step_measured_s: float = 0.0
    auto_tpot_target_s: float = 0.0
    # Prefix cache in tokens (prefix_queries/prefix_hits above count lookups): tokens of the
    # admitted requests that looked up, and the tokens their cached blocks covered.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    # Speculative decoding: tokens proposed and verified so far, and those the model accepted
    # (vLLM's spec_decode_num_draft_tokens / spec_decode_num_accepted_tokens).
    spec_decode_num_drafts: int = 0  # speculating rows verified
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # [i]: rows whose proposal at position i (0-based) was accepted (vLLM's
    # spec_decode_num_accepted_tokens_per_pos); as long as --num-speculative-tokens.
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # LoRA: the adapters of the running and of the waiting (queued or preempted) requests, by
    # name, and the cap on adapters running at once (0: none); vLLM's lora_requests_info.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    # The sizing rule (core/spec_sizing.py): sequence-passes it gave no proposal, and in its
    # latest pass the rows it sized and the proposals it chose for them.
    spec_decode_num_sized_off: int = 0
    spec_decode_sized_rows: int = 0
    spec_decode_sized_proposals: int = 0

    @property
    def spec_decode_mean_k(self) -> float:
        """Proposals per sized row in the latest sizing (0 before any)."""
        rows = self.spec_decode_sized_rows
        return self.spec_decode_sized_proposals / rows if rows else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted over proposed tokens since start (0 before any proposal)."""
        drafted = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafted if drafted else 0.0
    # The host swap pool: blocks holding swapped-out KV, and its size (0 without swap space).
    num_host_used_blocks: int = 0
    num_host_blocks: int = 0


@dataclass
class IterationRecord:
    """One engine step, for telemetry, guardrails and simulator calibration."""

    step: int
    time: float
    num_seqs: int
    num_decode_tokens: int
    num_prefill_tokens: int
    context_tokens: int  # sum of context lengths attended over (KV read)
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_preempted: int
    latency_s: float
    num_padding_tokens: int = 0  # static padding rows among the decode tokens
    execute_s: float = 0.0  # the executor's own measurement of the forward pass
    predicted_s: float = 0.0  # what the step-cost model predicted for it
    tpot_target_s: float | None = None
    prefill_budget_tokens: int = 0
    # The fitted step-cost terms after this step (core/step_cost.py FEATURES -> s per unit).
    step_cost: dict[str, float] = field(default_factory=dict)

