"""What one pass's rows do to their requests, once it ran: the work of
`Scheduler.update_from_output`.

Every row's request has computed its tokens: a block it filled is registered in the prefix
cache, and under a sliding window what its next query cannot read is released. A row that
sampled appends its token and ends its request on EOS (unless ignored), a stop token id,
max_tokens or the model length. Speculating rows keep what verification accepted
(core/verification.py).
"""

from __future__ import annotations

from everystop.core.intake import model_len_limit
from everystop.core.outputs import ModelOutput, RequestUpdate, SchedulerOutput
from everystop.core.request import RequestStatus
from everystop.core.scheduler_state import SchedulerState
from everystop.core.verification import apply_verified


def apply_pass_results(sched: SchedulerState, out: SchedulerOutput,
                       result: ModelOutput) -> list[RequestUpdate]:
    """Apply `result` (what the executor sampled for `out`); an update per request that got
    tokens or finished, in the pass's row order."""
    updates: list[RequestUpdate] = []
    now = sched.clock()
    # Loop invariants hoisted: this loop runs once per scheduled row (the hot path).
    # The prefix-cache registration (cache_computed_blocks) is called only for rows that
    # filled a block since their last registration: its own first check, inlined.
    requests, running = sched.requests, RequestStatus.RUNNING
    kv = sched.kv
    cache_blocks, caching = kv.cache_computed_blocks, kv.enable_prefix_caching
    # Under a sliding window, each row releases what its next query cannot read (after
    # registering it: released blocks stay in the prefix cache).
    release = kv.release_behind_window if kv.window is not None else None
    lag = sched.padding_lag
    registered, bs = kv.registered_blocks, kv.block_size
    prompt_logprobs, logprobs = result.prompt_logprobs, result.logprobs
    sampled = result.sampled_token_ids
    max_len = model_len_limit(sched.config, kv)
    for entry in out.scheduled:
        rid = entry.request_id
        req = requests.get(rid)
        if req is None or req.status is not running:
            continue  # aborted while the pass ran
        if entry.num_draft_tokens:
            update = apply_verified(sched, entry, req, result.verified_token_ids.get(rid),
                                    max_len, result.verified_logprobs.get(rid))
            if update is not None:
                updates.append(update)
            continue
        computed = req.num_computed_tokens = entry.start_pos + len(entry.token_ids)
        if caching and computed // bs > registered.get(rid, 0):
            cache_blocks(req)
        if release is not None:
            release(req, computed - lag)
        if prompt_logprobs:
            scored = prompt_logprobs.get(rid)
            if scored:
                req.keep_prompt_logprobs(entry.start_pos, scored)
        if not entry.sample:
            continue
        token = sampled[rid]
        output = req.output_token_ids
        output.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        update = RequestUpdate(rid, [token])
        params = req.sampling_params
        if params.prompt_logprobs is not None and len(output) == 1:
            update.prompt_logprobs = list(req.prompt_logprobs)
        if logprobs:
            lp = logprobs.get(rid)
            if lp is not None:
                update.new_logprobs.append(lp)
        # How the request ends with `token` just appended: EOS (unless ignored) or a stop
        # token id, then max_tokens or the model length; most rows go on.
        num_output = len(output)
        if (not params.ignore_eos and token == req.eos_token_id) or (
                token in params.stop_token_ids):
            update.stop_token_id = token
            status = RequestStatus.FINISHED_STOPPED
        elif (num_output >= params.max_tokens
              or len(req.prompt_token_ids) + num_output >= max_len):
            status = RequestStatus.FINISHED_LENGTH
        else:
            updates.append(update)
            continue
        sched.finish(req, status)
        update.finish_reason = status.finish_reason
        updates.append(update)
    return updates
