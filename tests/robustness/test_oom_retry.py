"""A forward pass that runs out of memory is retried smaller, not failed: the scheduler's
victim policy takes the lower-ranked half of the batch out (recomputed later), the rest runs
again, and only a sequence that cannot run even alone fails. No model: a toy executor that
raises MemoryError (or torch's CUDA OOM) before touching the cache, for the passes it is told to.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from everystop.core.oom_backoff import SeatCap
from everystop.core.outputs import ModelOutput, SchedulerOutput
from everystop.engine.llm_engine import LLMEngine, is_out_of_memory
from everystop.sampling_params import SamplingParams
from tests.core.toy_executor import ToyExecutor, reference_output
from tests.engine.toy_engine import CharTokenizer, run_all, toy_engine_config

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


class OomExecutor(ToyExecutor):
    """The toy model, except that a pass `too_big(sched)` says does not fit raises `error`
    before any copy or write, as an allocation failing at the start of the pass would."""

    def __init__(self, too_big: Callable[[SchedulerOutput], bool], num_gpu_blocks: int,
                 block_size: int, num_cpu_blocks: int = 0,
                 error: Exception | None = None) -> None:
        super().__init__(num_gpu_blocks, block_size, num_cpu_blocks)
        self.too_big = too_big
        self.error = error or MemoryError("cannot allocate 1.5 GiB for activations")
        self.failed: list[list[str]] = []  # the request ids of every pass that ran out
        self.ran: list[list[str]] = []  # ... and of every pass that ran

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        ids = [e.request_id for e in sched.scheduled]
        if self.too_big(sched):
            self.failed.append(ids)
            raise self.error
        out = super().execute(sched)
        self.ran.append(ids)
        return out


def oom_engine(too_big: Callable[[SchedulerOutput], bool], num_blocks: int = 64,
               num_cpu_blocks: int = 0, error: Exception | None = None,
               **sched: object) -> tuple[LLMEngine, OomExecutor]:
    config = toy_engine_config(4, **(dict(max_num_seqs=4) | sched))
    executor = OomExecutor(too_big, num_blocks, 4, num_cpu_blocks, error)
    return LLMEngine(config, executor, CharTokenizer()), executor


@pytest.mark.parametrize("error", [MemoryError("cannot allocate 1.5 GiB"),
                                   torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to "
                                                               "allocate 2.00 GiB")])
def test_a_batch_too_big_for_memory_is_shrunk_and_every_request_completes(
        error: Exception) -> None:
    eng, ex = oom_engine(lambda s: len(s.scheduled) > 2, error=error)
    reqs = [eng.add_request(f"request number {i}", PARAMS) for i in range(6)]
    final = run_all(eng)  # check_integrity() after every step
    assert ex.failed, "the fault never fired"
    for r in reqs:
        assert final[r.request_id].finish_reason == "length"
        assert final[r.request_id].token_ids == reference_output(r.prompt_token_ids, 12)
    assert max(len(ids) for ids in ex.ran) == 2
    assert eng.scheduler.num_preemptions["recompute"] >= 2
    assert eng.stats().num_used_blocks == 0
    # The cap keeps victims out of a pass that does not fit: not one failed pass per step.
    assert len(ex.failed) <= 2 + len(ex.ran) // eng.scheduler.oom_seat_cap.regrow_after_passes


def test_the_victims_are_the_lower_ranked_half() -> None:
    eng, ex = oom_engine(lambda s: len(s.scheduled) > 2)
    tiers = {eng.add_request(f"tier {p} request", PARAMS, priority=p).request_id: p
             for p in (2, 0, 2, 0)}
    run_all(eng)
    first_retry = ex.ran[0]
    assert sorted(ex.failed[0]) == sorted(tiers)
    assert sorted(tiers[rid] for rid in first_retry) == [0, 0]


def test_a_sequence_too_big_even_alone_fails_and_nothing_else_does() -> None:
    huge = [ord(c) for c in "HUGE"]
    eng, ex = oom_engine(lambda s: any(e.token_ids[:4] == huge and e.start_pos == 0
                                       for e in s.scheduled))
    others = [eng.add_request(f"small {i}", PARAMS) for i in range(3)]
    bad = eng.add_request("HUGE prompt", PARAMS)
    final = run_all(eng)
    assert final[bad.request_id].finish_reason == "error"
    assert "MemoryError" in (final[bad.request_id].error or "")
    assert ex.failed[-1] == [bad.request_id]  # it failed only once it was alone
    for r in others:
        assert final[r.request_id].token_ids == reference_output(r.prompt_token_ids, 12)
    assert eng.stats().num_used_blocks == 0
    again = eng.add_request("still serving", PARAMS)
    assert run_all(eng)[again.request_id].finish_reason == "length"


@pytest.mark.parametrize("copy", ["out", "in"])
def test_requests_a_failed_pass_swapped_are_recomputed_not_trusted(copy: str) -> None:
    """The pass fails before its swap copies run: a request it swapped out (or in) has no good
    copy anywhere, so it must be recomputed; the toy model checks every cached token."""
    fired = []

    def too_big(s: SchedulerOutput) -> bool:
        copies = s.blocks_to_swap_out if copy == "out" else s.blocks_to_swap_in
        if copies and len(fired) < 2:
            fired.append(len(copies))
            return True
        return False

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    eng, _ = oom_engine(too_big, num_blocks=24, num_cpu_blocks=64, preemption_mode="swap",
                        max_num_seqs=6)
    reqs = [eng.add_request(f"a longer prompt, number {i}", params) for i in range(6)]
    final = run_all(eng)
    assert len(fired) == 2
    for r in reqs:
        assert final[r.request_id].finish_reason == "length"
        assert final[r.request_id].token_ids == reference_output(r.prompt_token_ids, 40)
    assert eng.stats().num_used_blocks == 0 and not eng.scheduler.kv.swapped_blocks


def test_seat_cap_halves_then_grows_back_one_seat_at_a_time() -> None:
    cap = SeatCap(regrow_after_passes=2)
    assert cap.seats(8) == 8
    cap.lower_to(3)
    seats = []
    for _ in range(12):
        seats.append(cap.seats(8))
        cap.pass_succeeded(8)
    assert seats == [3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8] and cap.limit is None


def test_out_of_memory_is_told_apart_from_other_faults() -> None:
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("CUDA error: an illegal memory access"))
    assert not is_out_of_memory(ValueError("out of memory"))
