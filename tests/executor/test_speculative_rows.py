"""The packed inputs sample each speculating row at its last 1+k positions, in order, and each
position is sampled as plain decoding would sample it."""

from __future__ import annotations

import torch

from everystop.core.outputs import ScheduledSequence
from everystop.executor.inputs import build_inputs
from everystop.executor.verify_rows import per_position_rows
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


def test_each_verified_position_samples_as_plain_decoding_would_there() -> None:
    """Position j of a speculating row samples output index i+j with the proposals before it
    among the tokens seen (penalties, bad words); plain rows are left as they are."""
    p = SamplingParams(temperature=0.8, seed=5, presence_penalty=0.5)
    plain = ScheduledSequence("a", [7], 4, [0], True, p, output_index=2,
                              prompt_token_ids=[1, 2, 3], output_token_ids=[8, 9])
    spec = ScheduledSequence("b", [9, 4, 6], 4, [1], True, p, output_index=2,
                             prompt_token_ids=[1, 2, 3], output_token_ids=[8, 9],
                             num_draft_tokens=2)
    rows = per_position_rows([plain, spec, spec, spec])
    assert rows[0] is plain and rows[1] is spec
    assert [r.output_index for r in rows] == [2, 2, 3, 4]
    assert [r.output_token_ids for r in rows] == [[8, 9], [8, 9], [8, 9, 4], [8, 9, 4, 6]]
    assert spec.output_token_ids == [8, 9]  # the request's own list is not grown
    bare = ScheduledSequence("c", [9, 4], 4, [1], True, p, output_index=0, num_draft_tokens=1)
    assert [r.output_token_ids for r in per_position_rows([bare, bare])] == [None, None]
