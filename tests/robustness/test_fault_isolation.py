"""A forward pass that raises costs only its culprit: the engine re-runs the pass's rows in
halves until the failing request is alone; it fails (an error output), and its batch-mates
go on with the tokens they would have had. No model: the toy executor, which checks every
cached token, and a fault that scribbles over the K/V slots of the pass before raising (a pass
dying half way), so a re-run that did not rewrite them would show in the outputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from everystop.core.outputs import ModelOutput, ScheduledSequence, SchedulerOutput
from everystop.engine.fault_isolation import search_budget
from everystop.engine.llm_engine import LLMEngine
from everystop.sampling_params import SamplingParams
from tests.core.toy_executor import ToyExecutor, reference_output
from tests.engine.toy_engine import CharTokenizer, run_all, toy_engine_config

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


class CulpritExecutor(ToyExecutor):
    """The toy model, except that a pass `raises(sched)` picks writes garbage tokens into the
    slots of every row it was to write, then raises."""

    def __init__(self, raises: Callable[[SchedulerOutput], bool], num_gpu_blocks: int,
                 num_cpu_blocks: int = 0) -> None:
        super().__init__(num_gpu_blocks, 4, num_cpu_blocks)
        self.raises = raises
        self.passes: list[tuple[list[str], bool]] = []  # (request ids, whether it ran)

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        ids = [e.request_id for e in sched.scheduled]
        if self.raises(sched):
            bs = self.block_size
            for e in sched.scheduled:
                for pos in range(e.start_pos, e.seq_len):
                    self.gpu[e.block_ids[pos // bs]][pos % bs] = (999, pos)
            self.passes.append((ids, False))
            raise RuntimeError("CUDA error: device-side assert triggered (injected)")
        out = super().execute(sched)
        self.passes.append((ids, True))
        return out


def engine(raises: Callable[[SchedulerOutput], bool], num_blocks: int = 256,
           num_cpu_blocks: int = 0, **sched: object) -> tuple[LLMEngine, CulpritExecutor]:
    config = toy_engine_config(4, **(dict(max_num_batched_tokens=128, chunk_size=64) | sched))
    executor = CulpritExecutor(raises, num_blocks, num_cpu_blocks)
    return LLMEngine(config, executor, CharTokenizer()), executor


def rows_of(pred: Callable[[ScheduledSequence], bool]) -> Callable[[SchedulerOutput], bool]:
    return lambda s: any(pred(e) for e in s.scheduled)


def is_bad(e: ScheduledSequence) -> bool:
    return e.request_id.startswith("bad")


def add(eng: LLMEngine, ids: list[str]) -> dict[str, list[int]]:
    return {rid: eng.add_request(f"prompt of {rid}", PARAMS, request_id=rid).prompt_token_ids
            for rid in ids}


def assert_innocents_untouched(eng: LLMEngine, final: dict[str, object],
                               prompts: dict[str, list[int]]) -> None:
    for rid, prompt in prompts.items():
        out = final[rid]
        if rid.startswith("bad"):
            assert out.finish_reason == "error"  # type: ignore[attr-defined]
            assert "RuntimeError" in out.error and "injected" in out.error  # type: ignore
        else:
            assert out.finish_reason == "length" and out.error is None  # type: ignore
            assert out.token_ids == reference_output(prompt, 12)  # type: ignore[attr-defined]
    assert eng.stats().num_used_blocks == 0


@pytest.mark.parametrize("culprit_at", [0, 3, 7])
def test_one_culprit_fails_alone_and_its_batch_mates_keep_their_tokens(culprit_at: int) -> None:
    eng, ex = engine(rows_of(is_bad))
    ids = [f"ok{i}" for i in range(8)]
    ids[culprit_at] = "bad"
    prompts = add(eng, ids)
    final = run_all(eng)  # check_integrity() after every step
    assert_innocents_untouched(eng, final, prompts)
    # One pass held all eight; the search ran two passes per halving (three halvings of 8
    # rows), three of them failing; the next step's pass runs the seven left.
    assert [len(ids) for ids, _ in ex.passes[:8]] == [8, 4, 4, 2, 2, 1, 1, 7]
    assert [ran for _, ran in ex.passes[:8]].count(False) == 4


def test_a_culprit_mid_stream_keeps_the_tokens_it_had() -> None:
    eng, _ = engine(rows_of(lambda e: is_bad(e) and e.output_index >= 3))
    prompts = add(eng, ["ok0", "bad", "ok1", "ok2"])
    final = run_all(eng)
    assert_innocents_untouched(eng, final, prompts)
    assert final["bad"].token_ids == reference_output(prompts["bad"], 12)[:3]  # type: ignore


def test_two_culprits_fail_and_nobody_else() -> None:
    eng, _ = engine(rows_of(is_bad))
    prompts = add(eng, ["ok0", "bad0", "ok1", "ok2", "ok3", "ok4", "bad1", "ok5"])
    assert_innocents_untouched(eng, run_all(eng), prompts)


def test_a_fault_in_every_pass_fails_the_batch_after_a_bounded_search() -> None:
    broken = [True]
    eng, ex = engine(lambda s: broken[0])
    prompts = add(eng, [f"bad{i}" for i in range(8)])
    final = run_all(eng)
    assert_innocents_untouched(eng, final, prompts)
    assert len(ex.passes) <= 1 + search_budget(8)
    broken[0] = False
    again = add(eng, ["ok"])
    assert_innocents_untouched(eng, run_all(eng), again)


def test_a_pass_that_fails_once_costs_nobody_anything() -> None:
    fired: list[int] = []

    def once(s: SchedulerOutput) -> bool:
        if not fired and len(s.scheduled) == 6:
            fired.append(1)
            return True
        return False

    eng, ex = engine(once)
    prompts = add(eng, [f"ok{i}" for i in range(6)])
    assert_innocents_untouched(eng, run_all(eng), prompts)
    assert fired and [ran for _, ran in ex.passes[:3]] == [False, True, True]


@pytest.mark.parametrize("copy", ["out", "in"])
def test_requests_the_failed_pass_swapped_are_recomputed(copy: str) -> None:
    """A pass with swap copies raises: its copies cannot be trusted (nor repeated), so the
    requests it swapped are recomputed; the rest re-run in halves; nobody fails."""
    fired: list[int] = []

    def raises(s: SchedulerOutput) -> bool:
        copies = s.blocks_to_swap_out if copy == "out" else s.blocks_to_swap_in
        if copies and len(fired) < 2:
            fired.append(len(copies))
            return True
        return False

    eng, _ = engine(raises, num_blocks=24, num_cpu_blocks=64, preemption_mode="swap",
                    max_num_seqs=6, max_num_batched_tokens=64, chunk_size=16)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reqs = [eng.add_request(f"a longer prompt, number {i}", params) for i in range(6)]
    final = run_all(eng)
    assert len(fired) == 2
    for r in reqs:
        assert final[r.request_id].finish_reason == "length"  # type: ignore[attr-defined]
        assert final[r.request_id].token_ids == reference_output(  # type: ignore
            r.prompt_token_ids, 40)
    assert eng.stats().num_used_blocks == 0 and not eng.scheduler.kv.swapped_blocks
