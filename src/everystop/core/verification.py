"""Speculative decoding inside the scheduler's own pass: proposals ride on decode rows, and the
model's own tokens decide how many are kept.

A speculating sequence's row in the pass (k proposals d1..dk after its last token t)::

    positions:  p       p+1   ...  p+k
    tokens:     t       d1    ...  dk          (K/V written at all 1+k positions)
    model says: g0      g1    ...  gk          (its next token after each position: greedy,
                                                or sampled as plain decoding would sample it)

    accepted: the longest a with d1..da == g0..g(a-1); new tokens: d1..da, then g(a)

So each pass gives 1 to k+1 tokens: exactly those plain greedy decoding would have given, and
with sampling a sample of the same distribution (num_accepted).
num_computed_tokens advances over t and the accepted proposals only (p+1+a); the K/V written
for rejected positions lies past it, is never read (attention covers computed positions) and is
overwritten as the sequence goes on, and the blocks that held only rejected positions go back
to the pool. The prefix cache registers computed blocks only, so never a rejected token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from everystop.core.outputs import RequestUpdate, ScheduledSequence, TokenLogprob
from everystop.core.pass_builder import PassBuilder
from everystop.core.request import Request, RequestStatus
from everystop.core.spec_room import arrival_likely, prompt_in_line
from everystop.core.spec_sizing import SizingRow
from everystop.core.speculation import BatchProposer, speculates
from everystop.core.step_cost import StepCostModel, StepShape

if TYPE_CHECKING:
    from everystop.core.scheduler_state import SchedulerState as Scheduler

logger = logging.getLogger(__name__)


def num_accepted(drafts: list[int], verified: list[int]) -> int:
    """How many proposals are kept: the longest run of drafts equal to the model's tokens.

    NOTE: with sampling (temperature > 0) this is the standard rejection rule for a proposer
    whose draft distribution q is a point mass on its token d: each position's token x is
    sampled from the target distribution p, so d is kept with probability p(d) = min(1,
    p(d)/q(d)), and on a rejection x is a sample of p given x != d, which is
    normalize(max(0, p - q)). The output is thus distributed exactly as the target's
    (executor/rejection_sampler.py has the rule for any q, and its tests)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == verified[accepted]:
        accepted += 1
    return accepted


def add_proposals(sched: Scheduler, step: PassBuilder, max_len: int,
                  prefilling: Iterable[Request] = ()) -> None:
    """Give each decode row of `step` whose request speculates the proposals the sizing rule
    chooses for it (core/spec_sizing.py, at most k), within the token budget and the KV pool
    above the watermark (proposals never take room running sequences may need); none while
    a prompt is in line for its first token or likely to arrive during the pass
    (core/spec_room.py; `prefilling`: the running rows still in their prompt)."""
    proposer, k_max = sched.proposer, sched.config.num_speculative_tokens
    assert proposer is not None
    if prompt_in_line(sched, prefilling) or arrival_likely(
            sched, step.now, sched.step_cost.predict(pass_shape(step))):
        return
    # A proposer that drafts many sequences in one go (a draft model: one forward pass per
    # step for all) is asked once, with each row's k planned against the budget up front.
    batch = proposer.propose_batch if isinstance(proposer, BatchProposer) else None
    budget, requests = step.budget, sched.requests
    rows: list[tuple[ScheduledSequence, Request, int]] = []
    for rid, entry in list(step.decodes.items()):
        if entry.padding or not speculates(entry.sampling_params):
            continue
        req = requests[rid]
        # Room for every proposal accepted plus the model's next token within max_tokens and
        # the model length (the stop checks would cut the excess, but it is wasted work).
        cap = min(k_max, entry.sampling_params.max_tokens - len(req.output_token_ids) - 1,
                  max_len - entry.start_pos - 2)
        if cap > 0:
            rows.append((entry, req, cap))
    if not rows:
        return
    left = budget.tokens_left
    # A draft model's own passes are priced by its fitted cost (DraftModelProposer.pass_cost),
    # a sequence's first one with the tokens the draft has not been shown yet.
    draft_cost = getattr(proposer, "pass_cost", None)
    sizer = sched.spec_sizer
    ks = sizer.choose(
        [SizingRow(req.request_id, cap, entry.start_pos + 1,
                   sizer.unseen(req.request_id, entry.start_pos + 1),
                   entry.sampling_params.max_tokens - len(req.output_token_ids))
         for entry, req, cap in rows],
        pass_shape(step), sched.step_cost.predict, step.now,
        draft=draft_cost.predict if isinstance(draft_cost, StepCostModel) else None)
    planned: list[tuple[ScheduledSequence, Request, int]] = []
    for (entry, req, _), k in zip(rows, ks):
        k = min(k, left if batch else budget.tokens_left)
        if k <= 0:
            continue
        if batch:
            planned.append((entry, req, k))
            left -= k
        else:
            _add(sched, step, entry, req,
                 proposer.propose(req.prompt_token_ids + req.output_token_ids, k)[:k])
    if batch and not planned and callable(idle := getattr(proposer, "idle_pass", None)):
        idle()  # a draft model that keeps its pass cost fresh while sized off
    if batch and planned:
        contexts = [req.prompt_token_ids + req.output_token_ids for _, req, _ in planned]
        for (_, req, _), context in zip(planned, contexts):
            sizer.drafted(req.request_id, len(context))
        for (entry, req, k), drafts in zip(planned, batch(contexts, [k for *_, k in planned])):
            _add(sched, step, entry, req, drafts[:k])


def pass_shape(step: PassBuilder) -> StepShape:
    """The step-cost features of the rows `step` holds so far (StepShape.from_output's)."""
    context = step.bulk_context
    for entry in (*step.decodes.values(), *step.prefills.values()):
        context += entry.start_pos + len(entry.token_ids)
    prefill = sum(e.num_tokens for e in step.prefills.values())
    return StepShape(prefill + step.num_draft, len(step.decodes) + step.num_bulk, context)


def _add(sched: Scheduler, step: PassBuilder, entry: ScheduledSequence, req: Request,
         drafts: list[int]) -> None:
    """Put a row's proposals in the pass, where the KV pool has room above the watermark;
    a structured-output row's only as far as its grammar accepts them."""
    kv = sched.kv
    if drafts and sched.draft_check is not None and (
            entry.sampling_params.structured_output is not None):
        drafts = sched.draft_check(req, drafts)
    if drafts and kv.allocate(req, 1 + len(drafts), reserve_watermark=True):
        step.add_drafts(entry, drafts, kv.block_ids(req.request_id), req.priority)


def apply_verified(sched: Scheduler, entry: ScheduledSequence, req: Request,
                   verified: list[int] | None, max_len: int,
                   logprobs: list[TokenLogprob] | None = None) -> RequestUpdate | None:
    """Apply a speculating row's result: keep the accepted proposals and the model's next
    token, each checked for a stop in turn (nothing after a stop is kept), advance the
    request over what its K/V now holds, and return the blocks past it.

    `verified`: the model's token at each of the row's 1+k positions (`logprobs`: theirs,
    where the request asked). None (or the
    wrong count) from an executor that does not verify: its one token follows the proposals,
    not the sequence, so the row counts as not run (None: no update; it decodes again next
    pass) and this scheduler stops speculating."""
    drafts = entry.token_ids[1:]
    if verified is None or len(verified) != len(drafts) + 1:
        logger.warning("the executor returned no verification for %s's %d proposals: "
                       "speculative decoding is off from now on", req.request_id, len(drafts))
        sched.proposer = None
        sched.kv.trim(req, req.num_computed_tokens)
        return None
    accepted = num_accepted(drafts, verified)
    sched.spec_sizer.observe(req.request_id, len(drafts), accepted)
    sched.num_drafts += 1
    sched.num_draft_tokens += len(drafts)
    sched.num_accepted_tokens += accepted
    per_pos = sched.num_accepted_tokens_per_pos
    for pos in range(accepted):
        per_pos[pos] += 1
    new_tokens = verified[:accepted + 1]  # == drafts[:accepted] + [verified[accepted]]
    update = RequestUpdate(req.request_id, [])
    status = None
    params, output = req.sampling_params, req.output_token_ids
    for i, token in enumerate(new_tokens):
        output.append(token)
        update.new_token_ids.append(token)
        if logprobs is not None:
            update.new_logprobs.append(logprobs[i])
        if (not params.ignore_eos and token == req.eos_token_id) or (
                token in params.stop_token_ids):
            update.stop_token_id = token
            status = RequestStatus.FINISHED_STOPPED
        elif (len(output) >= params.max_tokens
              or len(req.prompt_token_ids) + len(output) >= max_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            break
    if req.first_token_time is None:
        req.first_token_time = sched.clock()
    # The row's K/V is valid through its last token and the accepted proposals; of those,
    # the request holds what it kept (all of them unless it stopped on a proposal).
    req.num_computed_tokens = min(entry.start_pos + 1 + accepted, req.num_tokens)
    if status is not None:
        sched.finish(req, status)
        update.finish_reason = status.finish_reason
        return update
    kv = sched.kv
    kv.cache_computed_blocks(req)
    if kv.window is not None:
        kv.release_behind_window(req, req.num_computed_tokens - sched.padding_lag)
    kv.trim(req, req.num_computed_tokens)
    return update
