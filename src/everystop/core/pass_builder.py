"""The forward pass one `Scheduler.schedule()` call is building: its rows and its budget.

Made fresh inside every schedule() call and dropped at its end, so no scheduler attribute is
"valid only during schedule()".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from everystop.config import SchedulerConfig
from everystop.core.outputs import ScheduledSequence, SchedulerOutput
from everystop.core.request import Request
from everystop.core.step_budget import StepBudget, ttft_stretch


@dataclass
class PassBuilder:
    now: float
    budget: StepBudget
    out: SchedulerOutput
    decodes: dict[str, ScheduledSequence] = field(default_factory=dict)
    prefills: dict[str, ScheduledSequence] = field(default_factory=dict)
    # Requests that joined the running batch in this pass: never preempted within it.
    admitted_now: set[str] = field(default_factory=set)
    # Rule 5 stretch each prefill size was granted under, until its row is emitted.
    stretched: dict[str, float] = field(default_factory=dict)
    # Static padding rows among `decodes` (counted as emitted: never dropped, see drop()).
    num_padding: int = 0
    # Decode rows a caller holds in bulk (core/decode_batch.py), budgeted but not in `decodes`.
    num_bulk: int = 0
    bulk_context: int = 0
    # Proposed tokens riding on speculating decode rows (see add_drafts).
    num_draft: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills or self.num_bulk)

    def prefill_size(self, cfg: SchedulerConfig, req: Request, start: int) -> int:
        """Prefill tokens `req` gets this pass from position `start` (see core/step_budget.py
        for the time budget and the anti-starvation floor)."""
        remaining = req.num_tokens - start
        if self.budget.tokens_left <= 0 or remaining <= 0:
            return 0
        budget = self.budget
        waited_since = req.preemption_times[-1] if req.preemption_times else req.arrival_time
        waited = self.now - waited_since
        starving = waited >= cfg.aging_interval_s
        if cfg.enable_chunked_prefill:
            chunk = cfg.chunk_size
            stretch = 1.0
            if (cfg.ttft_target_ms != 0 and budget.timed
                    and budget.targets_s[req.priority] is not None):
                if not (self.decodes or self.num_bulk):
                    chunk = budget.max_tokens  # rule 6: nothing to interleave with
                elif cfg.tpot_max_stretch > 1.0 and budget.may_stretch(req.priority):
                    lateness = waited + budget.alone_s(remaining, start)  # rule 5
                    stretch = ttft_stretch(lateness, budget.ttft_target_s(
                        cfg.ttft_target_ms, req.priority, cfg.chunk_size), cfg.tpot_max_stretch)
                    # the chunk cap grows with the stretch, to the token cap at the most
                    grow = (stretch - 1.0) / (cfg.tpot_max_stretch - 1.0)
                    chunk += max(0, math.floor((budget.max_tokens - chunk) * grow))
            n = min(remaining, chunk, budget.room(start, starving, stretch))
            if budget.last_room_stretch > 1.0:
                self.stretched[req.request_id] = budget.last_room_stretch
            return n
        # Whole prompts only; one oversized prompt may run alone, a starving one may overshoot
        # the target (a floor chunk cannot help a prompt that must run whole).
        room = budget.tokens_left if starving else budget.room(start)
        if remaining <= room or self.is_empty:
            return remaining
        return 0

    def emit(self, req: Request, n: int, block_ids: list[int], budgeted: bool = False) -> None:
        """Schedule tokens num_computed_tokens .. +n of `req` (`budgeted`: a decode row held in
        bulk and given back, whose budget was counted already)."""
        # NOTE: runs once per scheduled row (the simulator's hot path): lengths are read once,
        # the token slice (Request.token_slice) and a decode row's budget (StepBudget.add)
        # are inlined, and the row is built positionally.
        start = req.num_computed_tokens
        end = start + n
        params = req.sampling_params
        prompt, output = req.prompt_token_ids, req.output_token_ids
        num_prompt, num_output = len(prompt), len(output)
        if end <= num_prompt:
            tokens = prompt[start:end]
        elif start >= num_prompt:
            tokens = output[start - num_prompt:end - num_prompt]
        else:
            tokens = prompt[start:] + output[:end - num_prompt]
        in_prompt = start < num_prompt
        rid = req.request_id
        entry = ScheduledSequence(rid, tokens, start, block_ids, end == num_prompt + num_output,
                                  params, num_output, in_prompt, lora_id=req.lora_id)
        # Penalties and multi-token bad words read the tokens generated so far.
        if params.penalizes or params.bad_words_token_ids or (
                params.prompt_logprobs is not None and in_prompt):
            entry.prompt_token_ids, entry.output_token_ids = prompt, output
        if params.min_tokens > num_output:
            entry.eos_token_id = None if params.ignore_eos else req.eos_token_id
        budget = self.budget
        if n == 1 and end == num_prompt + num_output:
            self.decodes[rid] = entry
            if budgeted:
                return
            budget.add_decode_row(start, req.priority)
        else:
            self.prefills[rid] = entry
            budget.add(n, start, decode=False, tier=req.priority)
            stretch = self.stretched.pop(rid, 1.0) if self.stretched else 1.0
            if stretch > 1.0:
                budget.use_stretch(stretch)
            return
        if self.stretched:  # a size granted to a row that is emitted as a decode: dropped
            self.stretched.pop(rid, None)

    def add_drafts(self, entry: ScheduledSequence, drafts: list[int], block_ids: list[int],
                   tier: int) -> None:
        """Turn a decode row into a speculating one: its last token plus `drafts` to verify
        (`block_ids`: its table, grown for them). The drafts are budgeted as prefill tokens
        are: they run as extra query rows of the sequence."""
        entry.token_ids = entry.token_ids + drafts
        entry.block_ids = block_ids
        entry.num_draft_tokens = len(drafts)
        self.num_draft += len(drafts)
        self.budget.add(len(drafts), entry.start_pos + 1, decode=False, tier=tier)

    def emit_padding(self, req: Request, block_ids: list[int]) -> None:
        """A finished static-batch member recomputed at its last position (no sample)."""
        pos = req.num_computed_tokens - 1
        rid = req.request_id + "#padding"
        self.decodes[rid] = ScheduledSequence(
            request_id=rid, token_ids=req.token_slice(pos, pos + 1), start_pos=pos,
            block_ids=block_ids, sample=False, sampling_params=req.sampling_params,
            padding=True, lora_id=req.lora_id)
        self.num_padding += 1
        self.budget.add(1, pos, decode=True, tier=None)

    def drop(self, request_id: str) -> None:
        """Take a preempted request's row back out of the pass."""
        for rows, decode in ((self.decodes, True), (self.prefills, False)):
            entry = rows.pop(request_id, None)
            if entry is not None:
                self.num_padding -= entry.padding  # never a padding row (its id has "#padding")
                drafts = entry.num_draft_tokens
                if drafts:
                    self.num_draft -= drafts
                    self.budget.remove(drafts, entry.start_pos + 1, decode=False)
                self.budget.remove(entry.num_tokens - drafts, entry.start_pos, decode=decode)

    def finish(self) -> SchedulerOutput:
        out, budget = self.out, self.budget
        out.scheduled = [*self.decodes.values(), *self.prefills.values()]
        out.num_decode_tokens = len(self.decodes) + self.num_bulk
        out.num_bulk_decodes, out.bulk_context_tokens = self.num_bulk, self.bulk_context
        out.num_padding_tokens = self.num_padding
        out.num_draft_tokens = self.num_draft
        out.num_prefill_tokens = sum(e.num_tokens for e in self.prefills.values())
        out.predicted_time_s = budget.predicted_s
        out.tpot_target_s = budget.effective_target_s
        out.tpot_stretch = budget.stretch
        out.prefill_budget_tokens = budget.prefill_budget_tokens
        return out
