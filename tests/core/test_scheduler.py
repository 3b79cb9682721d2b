"""Scheduler behaviour with no model: the design's promises, one test each."""

from __future__ import annotations

import pytest

from everystop.config import ConfigError, SchedulerConfig
from everystop.core.scheduler import QueueFull, RequestRejected

from .helpers import make_harness
from .toy_executor import reference_output


def test_config_rejects_budget_below_seq_cap() -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=64)


def test_request_submitted_while_others_decode_joins_the_very_next_batch() -> None:
    h = make_harness()
    h.add("a", list(range(10)), 50)
    h.add("b", list(range(20, 30)), 50)
    for _ in range(3):
        h.step()
    h.add("late", [7, 8, 9], 5)
    sched, _ = h.step()
    ids = [e.request_id for e in sched.scheduled]
    assert "late" in ids
    assert ids.index("late") > ids.index("a")  # decodes first


def test_finished_sequence_frees_blocks_before_next_batch() -> None:
    h = make_harness()
    h.add("short", list(range(9)), 2)
    h.add("long", list(range(50, 59)), 40)
    while "short" not in h.finish:
        h.step()
    assert "short" not in h.scheduler.kv.req_blocks
    sched = h.scheduler.schedule()
    assert "short" in sched.finished_request_ids
    assert all(e.request_id != "short" for e in sched.scheduled)


def test_decode_tokens_precede_prefill_and_limits_hold() -> None:
    h = make_harness(max_num_seqs=4, max_num_batched_tokens=20, chunk_size=8)
    for i in range(10):
        h.add(f"r{i}", list(range(i, i + 30)), 12)
    while h.scheduler.has_unfinished:
        sched, _ = h.step()
        assert sched.num_scheduled_tokens <= 20
        assert len(sched.scheduled) <= 4
        kinds = [e.num_tokens == 1 and not e.is_prefill for e in sched.scheduled]
        # all decodes come before any prefill chunk
        assert kinds == sorted(kinds, reverse=True)


# TTFT aging off (the default): chunk_size binds; on: a 4000-token prompt is late from the
# start (step_budget.py rule 5), its chunks grow to what the token cap leaves the decodes.
@pytest.mark.parametrize(("ttft_target_ms", "max_chunk"),
                         [(0.0, 256), ("auto", 512 - 4)])
def test_long_prompt_is_chunked_while_running_sequences_keep_decoding(ttft_target_ms,
                                                                      max_chunk) -> None:
    h = make_harness(num_blocks=2048, block_size=16, max_num_seqs=8,
                     max_num_batched_tokens=512, chunk_size=256, max_model_len=8192,
                     ttft_target_ms=ttft_target_ms)
    for i in range(4):
        h.add(f"d{i}", list(range(i, i + 20)), 200)
    for _ in range(3):
        h.step()
    h.add("big", [5] * 4000, 4)
    chunks = 0
    while "big" not in h.outputs or not h.outputs["big"]:
        sched, _ = h.step()
        decodes = {e.request_id for e in sched.scheduled if not e.is_prefill}
        assert decodes == {f"d{i}" for i in range(4)}  # every running sequence advanced
        big = [e for e in sched.scheduled if e.request_id == "big"]
        if big:
            assert big[0].num_tokens <= max_chunk
            chunks += 1
    assert chunks >= 4000 // max_chunk


def test_outputs_equal_running_alone() -> None:
    h = make_harness(max_num_seqs=5, max_num_batched_tokens=24, chunk_size=7)
    prompts = {f"r{i}": list(range(i * 3, i * 3 + 5 + 7 * i)) for i in range(12)}
    for rid, p in prompts.items():
        h.add(rid, p, 9 + len(p) % 5)
    h.run()
    for rid, p in prompts.items():
        assert h.outputs[rid] == reference_output(p, 9 + len(p) % 5)
        assert h.finish[rid] == "length"


def test_eos_and_stop_token_finish() -> None:
    h = make_harness()
    prompt = [1, 2, 3]
    ref = reference_output(prompt, 10)
    h.add("e", prompt, 10, eos=ref[3])
    h.run()
    assert h.outputs["e"] == ref[:4] and h.finish["e"] == "stop"


def test_abort_frees_blocks_at_once() -> None:
    h = make_harness()
    h.add("a", list(range(40)), 100)
    h.add("w", list(range(40)), 100)
    h.step()
    used = h.scheduler.kv.pool.num_used_blocks
    assert used > 0
    h.scheduler.abort_requests(["a", "w", "unknown"])
    assert h.scheduler.kv.pool.num_used_blocks == 0
    assert not h.scheduler.has_unfinished
    h.scheduler.check_integrity()


def test_prefix_cache_hit_skips_prefill_and_keeps_output() -> None:
    h = make_harness(block_size=4)
    system = list(range(100, 140))
    h.add("first", system + [1, 2, 3], 5)
    h.run()
    second = h.add("second", system + [9, 9], 5)
    sched, _ = h.step()
    entry = next(e for e in sched.scheduled if e.request_id == "second")
    assert second.num_cached_tokens == 40 and entry.start_pos == 40
    h.run()
    assert h.outputs["second"] == reference_output(system + [9, 9], 5)


def test_fully_cached_prompt_still_computes_last_token() -> None:
    h = make_harness(block_size=4)
    prompt = list(range(16))
    h.add("a", prompt, 3)
    h.run()
    h.add("b", prompt, 3)
    sched, _ = h.step()
    entry = next(e for e in sched.scheduled if e.request_id == "b")
    assert entry.start_pos == 12 and entry.num_tokens == 4 and entry.sample
    h.run()
    assert h.outputs["b"] == reference_output(prompt, 3)


def test_rejects_requests_that_can_never_run() -> None:
    h = make_harness(num_blocks=10, block_size=4, max_model_len=100)
    with pytest.raises(RequestRejected, match="max_model_len"):
        h.add("x", [1] * 90, 20)
    with pytest.raises(RequestRejected, match="KV blocks"):
        h.add("y", [1] * 30, 20)
    with pytest.raises(RequestRejected, match="empty"):
        h.add("z", [], 5)
    assert not h.scheduler.has_unfinished


def test_unset_max_model_len_is_what_the_pool_holds_for_one_sequence() -> None:
    h = make_harness(num_blocks=10, block_size=4, max_model_len=None)
    with pytest.raises(RequestRejected, match=r"max_model_len \(40\)"):
        h.add("x", [1] * 30, 11)
    h.add("y", [1] * 30, 10)
    h.run()
    assert len(h.outputs["y"]) == 10
    # Blocks behind the watermark are not for one new sequence: (10 - 2) * 4 tokens.
    kept = make_harness(num_blocks=10, block_size=4, watermark=0.2, max_model_len=None)
    with pytest.raises(RequestRejected, match=r"max_model_len \(32\)"):
        kept.add("x", [1] * 30, 3)


def test_queue_caps_raise_queue_full() -> None:
    h = make_harness(max_queued_per_tenant=2, max_queued_per_tier=(0, 3, 0))
    h.add("a", [1, 2], 2, tenant="x")
    h.add("b", [1, 2], 2, tenant="x")
    with pytest.raises(QueueFull, match="tenant"):
        h.add("c", [1, 2], 2, tenant="x")
    h.add("d", [1, 2], 2, tenant="y")
    with pytest.raises(QueueFull, match="tier"):
        h.add("e", [1, 2], 2, tenant="z")
    h.step()  # admitted requests leave the queue and free its places
    h.add("f", [1, 2], 2, tenant="x")


def test_static_batching_waits_for_a_full_batch_and_admits_nothing_meanwhile() -> None:
    h = make_harness(scheduling="static", max_batch_size=3, static_batch_timeout_s=5.0)
    h.add("a", [1, 2, 3], 4)
    h.add("b", [4, 5, 6], 10)
    sched, _ = h.step()
    assert not sched.scheduled  # doors shut: batch not full, timeout not reached
    h.add("c", [7, 8], 4)
    sched, _ = h.step()
    assert {e.request_id for e in sched.scheduled} == {"a", "b", "c"}
    h.add("d", [9], 3)
    while "b" not in h.finish:
        sched, _ = h.step()
        assert "d" not in {e.request_id for e in sched.scheduled}
    h.clock.now += 10  # timeout lets a partial batch go
    h.run()
    assert h.outputs["d"] == reference_output([9], 3)


def test_static_padding_keeps_finished_members_computed_until_the_batch_drains() -> None:
    h = make_harness(scheduling="static", max_batch_size=3, static_batch_timeout_s=0.0)
    lengths = {"a": 2, "b": 9, "c": 5}
    for i, (rid, n) in enumerate(lengths.items()):
        h.add(rid, [10 * i + 1, 10 * i + 2, 10 * i + 3], n)
    h.add("next", [99], 2)
    blocks_used = h.scheduler.kv.pool.num_used_blocks
    while "b" not in h.finish:
        finished_before = set(h.finish)
        sched, _ = h.step()
        assert "next" not in {e.request_id for e in sched.scheduled}
        if sched.num_prefill_tokens:
            continue
        # every decode step of the batch has all three seats computed, finished or not
        assert len(sched.scheduled) == 3 == sched.num_decode_tokens
        pads = [e for e in sched.scheduled if e.padding]
        assert sched.num_padding_tokens == len(pads)
        assert {e.request_id for e in pads} == {f"{r}#padding" for r in finished_before}
        assert all(not e.sample for e in pads)
        for r in ("a", "c"):  # a finished member keeps its blocks while it pads
            assert (r in h.scheduler.kv.req_blocks) == ("b" not in h.finish)
        h.scheduler.check_integrity()
    # the batch drained: every block is back, and the next batch runs
    assert h.scheduler.kv.pool.num_used_blocks == blocks_used
    h.run()
    for i, (rid, n) in enumerate(lengths.items()):
        assert h.outputs[rid] == reference_output([10 * i + 1, 10 * i + 2, 10 * i + 3], n)
    assert h.outputs["next"] == reference_output([99], 2)


def test_static_without_padding_drops_finished_members_from_the_pass() -> None:
    h = make_harness(scheduling="static", max_batch_size=2, static_batch_timeout_s=0.0,
                     static_padding=False)
    h.add("a", [1, 2], 2)
    h.add("b", [3, 4], 8)
    while h.scheduler.has_unfinished:
        sched, _ = h.step()
        assert not any(e.padding for e in sched.scheduled)
        if "a" in h.finish:
            assert "a" not in h.scheduler.kv.req_blocks
    assert h.outputs["b"] == reference_output([3, 4], 8)


def test_no_chunked_prefill_runs_whole_prompts() -> None:
    h = make_harness(enable_chunked_prefill=False, max_num_batched_tokens=64)
    h.add("a", list(range(50)), 3)
    h.add("b", list(range(40)), 3)
    sched, _ = h.step()
    assert [e.num_tokens for e in sched.scheduled] == [50]
    h.run()
    assert h.outputs["b"] == reference_output(list(range(40)), 3)


def test_hot_lowered_max_num_seqs_applies_next_step() -> None:
    h = make_harness(max_num_seqs=6)
    for i in range(6):
        h.add(f"r{i}", [i, i + 1, i + 2], 30)
    h.step()
    assert len(h.scheduler.running) == 6
    h.scheduler.update_config(h.scheduler.config.replace(max_num_seqs=2))
    sched, _ = h.step()
    assert len(sched.scheduled) <= 2 and len(h.scheduler.running) <= 2
    h.run()
    for i in range(6):
        assert h.outputs[f"r{i}"] == reference_output([i, i + 1, i + 2], 30)


def test_core_never_imports_torch() -> None:
    import subprocess
    import sys
    code = ("import sys, everystop.core.scheduler, everystop.core.kv_cache_manager, "
            "everystop.config, everystop.sampling_params; "
            "assert 'torch' not in sys.modules, 'core imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
