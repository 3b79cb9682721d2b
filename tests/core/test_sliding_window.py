"""Sliding windows in the KV cache: a sequence holds only the blocks its window can still read,
through chunked prefill, preemption (recompute and swap), static padding and the prefix cache.
The toy executor reads only each query's window, so a block released too early (and reused by
another sequence) shows up as a corrupted slot or a different output."""

from __future__ import annotations

import pytest

from everystop.core.intake import RequestRejected
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.request import Request
from everystop.core.sliding_window import SlidingWindow
from everystop.sampling_params import SamplingParams

from .helpers import Harness, check_swap_pairs, make_harness
from .toy_executor import reference_output

WINDOWS = [(16, 4), (10, 4), (3, 4), (8, 1), (12, 8)]  # (window, block size)


def test_window_arithmetic() -> None:
    w = SlidingWindow(8, 4)
    # A query at 11 reads 4..11: block 1 on; at 10 it reads 3..10, block 0 too.
    assert [w.first_live_block(p) for p in (0, 7, 10, 11, 15, 16)] == [0, 0, 0, 1, 2, 2]
    assert w.max_blocks_held(100, 1) == 3  # 8 positions straddle at most 3 blocks
    assert w.max_blocks_held(6, 64) == 2  # never more than the sequence's own blocks
    # Ending at 5 blocks needs blocks 3 and 4 (the window of position 20); 0..2 may be gone.
    assert w.longest_hit([False, False, True, True, True]) == 5
    assert w.longest_hit([False, False, True, False, True]) == 0
    assert w.longest_hit([True, True, True, False, True]) == 3
    assert SlidingWindow(10_000, 4).longest_hit([True, True, False, True]) == 2
    with pytest.raises(ValueError, match="window"):
        SlidingWindow(0, 4)


def _run_checking_tables(h: Harness) -> int:
    """Run to the end; every row's table is the null block exactly before its window (or one
    position earlier, for a static batch's member: it may end as a padding row). Returns the
    most blocks the KV manager counted in use at once."""
    kv, lag = h.scheduler.kv, h.scheduler.padding_lag
    assert kv.null_block is not None and kv.window is not None
    null, peak = kv.null_block.block_id, 0
    while h.scheduler.has_unfinished:
        sched, _ = h.step()
        peak = max(peak, kv.pool.num_used_blocks)
        for e in sched.scheduled:
            released = next((i for i, b in enumerate(e.block_ids) if b != null),
                            len(e.block_ids))
            assert null not in e.block_ids[released:], e
            first_live = kv.window.first_live_block
            assert first_live(e.start_pos - lag) <= released <= first_live(e.start_pos), e
            assert len(e.block_ids) * kv.block_size >= e.seq_len
        check_swap_pairs(sched, kv)
    return peak


@pytest.mark.parametrize(("window", "bs"), WINDOWS)
@pytest.mark.parametrize("shape", ["long_output", "long_prompt"])
def test_a_long_sequence_holds_at_most_its_window(window: int, bs: int, shape: str) -> None:
    # A pool far smaller than the sequence: only released blocks let it run at all.
    h = make_harness(num_blocks=window // bs + 4, block_size=bs, sliding_window=window,
                     max_num_seqs=1, max_num_batched_tokens=bs, chunk_size=bs)
    prompt = list(range(5, 5 + (window // 2 + 1 if shape == "long_output" else 8 * window)))
    max_tokens = 8 * window - len(prompt) if shape == "long_output" else window
    h.add("long", prompt, max_tokens)
    peak = _run_checking_tables(h)
    assert peak <= window / bs + 2
    assert peak <= h.scheduler.kv.max_blocks_held(8 * window, bs) < h.scheduler.kv.blocks_needed(
        8 * window)
    assert h.outputs["long"] == reference_output(prompt, max_tokens, window)
    assert h.scheduler.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_windowed_sequences_finish_as_if_alone(mode: str) -> None:
    h = make_harness(num_blocks=12, block_size=4, num_cpu_blocks=64, sliding_window=10,
                     max_num_seqs=6, max_num_batched_tokens=16, chunk_size=8,
                     preemption_mode=mode)
    prompts = {f"r{i}": list(range(i, i + 5 + (i * 7) % 30)) for i in range(10)}
    for rid, p in prompts.items():
        h.add(rid, p, 30)
    _run_checking_tables(h)
    for rid, p in prompts.items():
        assert h.outputs[rid] == reference_output(p, 30, 10), rid
    assert h.scheduler.num_preemptions[mode] > 0
    # Some victim had released entries when it left (the last row it ran shows them).
    null = h.scheduler.kv.null_block
    assert null is not None
    last_row = {}
    released_victims = 0
    for sched in h.history:
        released_victims += sum(null.block_id in last_row[rid].block_ids
                                for rid in sched.preempted_request_ids if rid in last_row)
        last_row.update((e.request_id, e) for e in sched.scheduled)
    assert released_victims > 0
    assert h.scheduler.kv.pool.num_used_blocks == 0 and h.scheduler.kv.num_swapped_blocks == 0


def test_swap_copies_only_held_blocks_and_restores_released_entries() -> None:
    kv = KVCacheManager(16, 4, num_cpu_blocks=16, sliding_window=6)
    assert kv.num_gpu_blocks == 15 and kv.null_block is not None
    null = kv.null_block.block_id
    req = Request("a", list(range(20)), SamplingParams(max_tokens=8))
    assert kv.allocate(req, 20)
    req.num_computed_tokens = 20
    kv.cache_computed_blocks(req)
    kv.release_behind_window(req, 20)  # position 20 reads 15..20: blocks 3 and 4
    assert kv.block_ids("a")[:3] == [null] * 3 and kv.num_held_blocks("a") == 2
    assert kv.pool.num_cached_free_blocks == 3  # registered, so kept reusable
    out = kv.swap_out(req)
    assert len(out) == 2 and null not in [d for d, _ in out]
    kv.check_integrity({"a"})
    assert kv.can_swap_in(req, 1)
    back = kv.swap_in(req, 1)
    assert [h for h, _ in back] == [h for _, h in out]
    assert kv.block_ids("a")[:3] == [null] * 3 and len(kv.block_ids("a")) == 6
    req.output_token_ids.append(7)
    req.num_computed_tokens = 21
    kv.cache_computed_blocks(req)  # registers again after the swap, skipping released entries
    assert kv.null_block.block_hash is None
    kv.check_integrity({"a"})
    kv.forget(req)
    kv.begin_step()
    assert kv.pool.num_used_blocks == 0
    kv.check_integrity(set())


def test_swap_pairs_copy_live_blocks_in_table_order() -> None:
    # Four host blocks, so the last one's id (3) equals the null block's device id: the pairs'
    # two sides are separate numberings, and only the device side must avoid the null block.
    kv = KVCacheManager(4, 2, num_cpu_blocks=4, sliding_window=4)
    assert kv.null_block is not None
    null = kv.null_block.block_id
    assert null == 3
    other = Request("b", [1, 2, 3, 4], SamplingParams(max_tokens=4))
    assert kv.allocate(other, 4)
    other.num_computed_tokens = 4
    assert [h for _, h in kv.swap_out(other)] == [0, 1]  # takes host blocks 0 and 1
    req = Request("a", list(range(6)), SamplingParams(max_tokens=4))
    assert kv.allocate(req, 6)
    req.num_computed_tokens = 6
    live = kv.block_ids("a")[1:]
    kv.release_behind_window(req, 6)  # position 6 reads 3..6: block 0 is released
    assert kv.block_ids("a") == [null, *live]
    out = kv.swap_out(req)
    assert out == [(live[0], 2), (live[1], 3)]  # live entries only, to host blocks 2 and 3
    kv.check_integrity({"a", "b"})
    back = kv.swap_in(req, 1)  # 7 tokens: the two copies and a block for the new token
    table = kv.block_ids("a")
    assert len(table) == 4 and table[0] == null and null not in table[1:]
    assert back == [(2, table[1]), (3, table[2])]  # each copy lands on its own entry
    kv.check_integrity({"a", "b"})


def _prefix_harness(num_blocks: int = 16) -> Harness:
    return make_harness(num_blocks=num_blocks, block_size=4, sliding_window=8, max_num_seqs=1,
                        max_num_batched_tokens=4, chunk_size=4)


def test_a_repeat_reuses_the_cached_window_after_the_start_was_evicted() -> None:
    h = _prefix_harness()
    kv = h.scheduler.kv
    prompt = list(range(100, 140))  # 10 full blocks
    h.add("a", prompt, 2)
    h.run()
    assert kv.pool.num_cached_free_blocks >= 10
    # Past the never-used blocks, it takes the least recently freed: a's first blocks.
    h.add("other", list(range(500, 520)), 1)
    h.run()
    first_blocks = kv._block_hashes(Request("x", prompt, SamplingParams()), 10)
    assert kv.pool.lookup(first_blocks[0], None, tuple(prompt[:4])) is None
    h.add("b", prompt + [7], 3)
    hits_before = kv.num_prefix_hit_tokens
    sched, _ = h.step()
    (row,) = sched.scheduled
    assert row.start_pos == 40 and kv.num_prefix_hit_tokens - hits_before == 40
    assert kv.null_block is not None and row.block_ids[:8] == [kv.null_block.block_id] * 8
    h.run()
    assert h.outputs["b"] == reference_output(prompt + [7], 3, 8)


def test_a_prefix_differing_before_the_window_never_hits() -> None:
    h = _prefix_harness(num_blocks=32)
    prompt = list(range(100, 140))
    h.add("a", prompt, 2)
    h.run()
    other = [99] + prompt[1:]  # same window tokens, another start: another hash chain
    h.add("c", other, 3)
    sched, _ = h.step()
    assert sched.scheduled[0].start_pos == 0
    h.run()
    assert h.outputs["c"] == reference_output(other, 3, 8)


def test_static_padding_rows_read_their_window_intact() -> None:
    h = make_harness(num_blocks=40, block_size=4, sliding_window=5, scheduling="static",
                     max_batch_size=3, static_batch_timeout_s=0.0, max_num_batched_tokens=64)
    prompts = {"a": list(range(3, 10)), "b": list(range(20, 31)), "c": list(range(40, 42))}
    # a and c finish with 8 and 16 tokens computed: a padding row's query (one back) then
    # reads the block its last decode's window has just passed.
    lengths = {"a": 2, "b": 21, "c": 15}
    for rid, p in prompts.items():
        h.add(rid, p, lengths[rid])
    _run_checking_tables(h)
    assert any(e.padding for s in h.history for e in s.scheduled)
    for rid, p in prompts.items():
        assert h.outputs[rid] == reference_output(p, lengths[rid], 5), rid


def test_intake_counts_the_window_only_when_passes_are_chunked() -> None:
    h = make_harness(num_blocks=12, block_size=4, sliding_window=8, max_num_seqs=1,
                     max_num_batched_tokens=8, chunk_size=8)
    h.add("long", list(range(200)), 100)  # 75 blocks unwindowed, in an 11-block pool
    plain = make_harness(num_blocks=12, block_size=4, max_num_seqs=1,
                         max_num_batched_tokens=8, chunk_size=8)
    with pytest.raises(RequestRejected, match="KV blocks"):
        plain.add("long", list(range(200)), 100)
    # Without chunked prefill a recompute re-prefills every token in one pass.
    whole = make_harness(num_blocks=12, block_size=4, sliding_window=8, max_num_seqs=1,
                         max_num_batched_tokens=200, enable_chunked_prefill=False)
    with pytest.raises(RequestRejected, match="KV blocks"):
        whole.add("long", list(range(200)), 100)
    h.run()
    assert h.outputs["long"] == reference_output(list(range(200)), 100, 8)
