"""The packed inputs sample each speculating row at its last 1+k positions, in order."""

from __future__ import annotations

import torch

from everystop.core.outputs import ScheduledSequence
from everystop.executor.inputs import build_inputs
from everystop.sampling_params import SamplingParams


def test_a_speculating_row_is_sampled_at_its_last_one_plus_k_positions() -> None:
    p = SamplingParams(temperature=0)
    seqs = [ScheduledSequence("a", [1, 2, 3], 0, [0], True, p),  # rows 0-2: prefill, sampled
            ScheduledSequence("b", [5, 6, 7, 8], 3, [1, 2], True, p, num_draft_tokens=3),
            ScheduledSequence("c", [9, 9], 0, [3], False, p),  # rows 7-8: not sampled
            ScheduledSequence("d", [4, 4], 6, [4, 5], True, p, num_draft_tokens=1)]
    inputs = build_inputs(seqs, 4, torch.device("cpu"))
    assert inputs.sample_indices.tolist() == [2, 3, 4, 5, 6, 9, 10]
    assert inputs.sample_seq_indices == [0, 1, 1, 1, 1, 3, 3]
    plain = build_inputs(seqs[:1] + seqs[2:3], 4, torch.device("cpu"))
    assert plain.sample_indices.tolist() == [2] and plain.sample_seq_indices == [0]
