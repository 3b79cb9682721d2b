"""Property-based tests: random arrivals, lengths, pool sizes and aborts, with and without a
sliding window; invariants every step."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from everystop.core.block_pool import BlockPool
from everystop.core.intake import peak_blocks
from everystop.sampling_params import StructuredOutput

from .helpers import check_swap_pairs, make_harness
from .toy_executor import reference_output

request_st = st.tuples(
    st.integers(min_value=0, max_value=40),  # arrival step
    st.lists(st.integers(min_value=3, max_value=60), min_size=1, max_size=40),  # prompt
    st.integers(min_value=1, max_value=25),  # max_tokens
    st.integers(min_value=0, max_value=2),  # priority
)


workload_st = dict(
    requests=st.lists(request_st, min_size=1, max_size=14),
    num_blocks=st.integers(min_value=20, max_value=80),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(min_value=1, max_value=8),
    extra_budget=st.integers(min_value=0, max_value=40),
    chunk_size=st.integers(min_value=1, max_value=32),
    mode=st.sampled_from(["recompute", "swap", "auto"]),
    prefix_caching=st.booleans(),
    aborts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 13)), max_size=3),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**workload_st)
def test_invariants_hold_and_everything_finishes(**workload) -> None:
    run_workload(**workload)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**workload_st, window=st.integers(min_value=1, max_value=24),
       scheduling=st.sampled_from(["continuous", "continuous", "static"]))
# Swaps fill the whole host space: the last host block's id equals the null block's device id.
@example(requests=[(0, [3], 3, 0), (0, [3, 3], 5, 1), (0, [3, 3], 1, 1), (1, [3], 11, 0),
                   (4, [3], 6, 0), (3, [3, 3], 8, 0)],
         num_blocks=20, block_size=1, max_num_seqs=3, extra_budget=0, chunk_size=2, mode="swap",
         prefix_caching=False, aborts=[], window=11, scheduling="continuous")
# A victim swapped out after growing a block this pass (for a token no pass has computed).
@example(requests=[(0, [3, 3, 3], 9, 0), (7, [3], 4, 1), (10, [3, 3], 1, 0),
                   (4, [3, 3, 3, 3, 3, 3, 3], 1, 1)],
         num_blocks=20, block_size=1, max_num_seqs=3, extra_budget=0, chunk_size=1, mode="swap",
         prefix_caching=False, aborts=[], window=11, scheduling="continuous")
def test_invariants_hold_under_a_sliding_window(window, scheduling, **workload) -> None:
    if scheduling == "static":  # the static baseline never swaps a victim back in
        workload["mode"] = "recompute"
    run_workload(**workload, sliding_window=window, scheduling=scheduling)


def run_workload(requests, num_blocks, block_size, max_num_seqs, extra_budget, chunk_size,
                 mode, prefix_caching, aborts, sliding_window=None,
                 scheduling="continuous", proposer=None, seeds=(), draft_check=None,
                 **speculation) -> None:
    """Run the requests through the toy executor, checking the invariants after every step
    (Harness.step) and more here; every request not aborted must produce what it produces
    alone. `proposer` (with the speculative options in `speculation`): decode rows carry its
    proposals. `seeds`: request i samples on seeds[i] where given (None or past the end:
    greedy). `draft_check`: installed as the scheduler's, every request then marked as
    structured output (its check cuts their proposals)."""
    h = make_harness(**speculation, num_blocks=num_blocks, block_size=block_size,
                     num_cpu_blocks=num_blocks,
                     max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_seqs + extra_budget,
                     chunk_size=chunk_size, preemption_mode=mode, prefix_caching=prefix_caching,
                     recompute_threshold_tokens=4, watermark=0.05,
                     sliding_window=sliding_window, scheduling=scheduling,
                     max_batch_size=max_num_seqs, static_batch_timeout_s=0.05)
    if proposer is not None:
        h.scheduler.proposer = proposer
    structured = None
    if draft_check is not None:
        h.scheduler.draft_check = draft_check
        structured = StructuredOutput("json_object")
    kv = h.scheduler.kv
    pool = kv.pool
    null = kv.null_block.block_id if kv.null_block is not None else None
    accepted: dict[str, tuple[list[int], int, int | None]] = {}
    aborted: set[str] = set()
    step = 0
    pending = sorted(enumerate(requests), key=lambda x: x[1][0])
    while pending or h.scheduler.has_unfinished:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens, prio) = pending.pop(0)
            seed = seeds[i] if i < len(seeds) else None
            try:
                h.add(f"r{i}", prompt, max_tokens, priority=prio, seed=seed,
                      structured_output=structured)
                accepted[f"r{i}"] = (prompt, max_tokens, seed)
            except ValueError:  # RequestRejected: too big for this pool
                needed = peak_blocks(len(prompt), max_tokens, h.scheduler.config, kv)
                assert needed > kv.num_gpu_blocks - kv.watermark_blocks
        for at, idx in aborts:
            if at == step and f"r{idx}" in h.scheduler.requests:
                h.scheduler.abort_requests([f"r{idx}"])
                aborted.add(f"r{idx}")
        sched, _ = h.step()
        step += 1
        assert step < 3000, "no progress: deadlock or livelock"
        # free + used == total, and cached blocks are a subset of the free ones
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.num_cached_free_blocks <= pool.num_free_blocks
        assert scheduling == "static" or sched.num_scheduled_tokens <= max(
            max_num_seqs + extra_budget, max((e.num_tokens for e in sched.scheduled), default=0))
        assert len(sched.scheduled) <= max_num_seqs
        owners: dict[int, str] = {}
        for e in sched.scheduled:  # no block is written by two sequences in one pass
            for pos in range(e.start_pos, e.seq_len):
                b = e.block_ids[pos // block_size]
                assert owners.setdefault(b, e.request_id) == e.request_id
        # Released entries are never written nor copied; nobody holds more than its window.
        assert null is None or null not in owners
        check_swap_pairs(sched, kv)
        for req in h.scheduler.running:
            assert kv.num_held_blocks(req.request_id) <= kv.max_blocks_held(
                req.num_tokens, max(max_num_seqs + extra_budget, len(req.prompt_token_ids))
                if scheduling == "static" else max_num_seqs + extra_budget)
    for rid, (prompt, max_tokens, seed) in accepted.items():
        if rid in aborted:
            continue
        assert h.outputs[rid] == reference_output(prompt, max_tokens, sliding_window, seed), rid
    assert pool.num_used_blocks == 0
    assert kv.num_swapped_blocks == 0


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "touch"]),
                              st.integers(0, 5)), max_size=60))
def test_block_pool_ref_counts_never_negative(ops) -> None:
    pool = BlockPool(16)
    held: list = []
    for op, n in ops:
        if op == "alloc" and n <= pool.num_free_blocks:
            blocks = pool.get_new_blocks(n)
            for b in blocks:
                pool.cache_block(b, hash((b.block_id, len(held))), None, (b.block_id,))
            held.extend(blocks)
        elif op == "free" and held:
            pool.free_blocks([held.pop(n % len(held))])
        elif op == "touch" and held:
            b = held[n % len(held)]
            pool.touch([b])
            held.append(b)
        pool.check_integrity()
        assert all(b.ref_cnt >= 0 for b in pool.blocks)
        assert pool.num_used_blocks == len({id(b) for b in held})
