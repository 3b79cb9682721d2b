"""The tensor-parallel control channel carries a step's plan whole: every field of
ScheduledSequence and SchedulerOutput survives the trip to the workers."""

from __future__ import annotations

import dataclasses
import pickle

from everystop.core.outputs import ScheduledSequence, SchedulerOutput
from everystop.executor.tp_group import decode_plan, encode_plan
from everystop.sampling_params import SamplingParams


def _all_set(obj: object) -> None:
    """Every field differs from its default, so a field the wire drops cannot go unnoticed."""
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if f.default is not dataclasses.MISSING:
            assert getattr(obj, f.name) != f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert getattr(obj, f.name) != f.default_factory(), f.name


def test_plan_round_trip_keeps_every_field() -> None:
    seq = ScheduledSequence("r1", [5, 6, 7], 12, [3, 9], True,
                            SamplingParams(max_tokens=9, temperature=0.5, seed=4, stop=["x"]),
                            output_index=2, is_prefill=True, padding=True,
                            prompt_token_ids=[1, 2], output_token_ids=[3], eos_token_id=2,
                            token_bitmask=[7], num_draft_tokens=1, lora_id=3)
    sched = SchedulerOutput(scheduled=[seq, dataclasses.replace(seq, request_id="r2")],
                            blocks_to_swap_out=[(1, 2)], blocks_to_swap_in=[(3, 4)],
                            finished_request_ids=["f"], preempted_request_ids=["p"],
                            swapped_in_request_ids=["s"],
                            num_decode_tokens=1, num_prefill_tokens=5, num_padding_tokens=1,
                            predicted_time_s=0.05, tpot_target_s=0.1, prefill_budget_tokens=64,
                            tpot_stretch=1.5, num_bulk_decodes=2, bulk_context_tokens=30,
                            num_draft_tokens=2, running_lora_ids=frozenset({3}))
    _all_set(seq)
    _all_set(sched)
    got = decode_plan(pickle.loads(pickle.dumps(encode_plan(sched))))
    assert got == sched
    for name in (f.name for f in dataclasses.fields(ScheduledSequence)):
        assert getattr(got.scheduled[0], name) == getattr(seq, name), name
