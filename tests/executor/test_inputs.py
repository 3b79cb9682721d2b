"""Packing a step's sequences into model inputs: the one-token-per-sequence path builds exactly
what the whole-array path builds."""

from __future__ import annotations

import random

import pytest
import torch

from everystop.core.outputs import ScheduledSequence
from everystop.executor.inputs import (
    ModelInputs,
    build_decode_inputs,
    build_inputs,
    build_packed_inputs,
)
from everystop.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
CPU = torch.device("cpu")


def _decode_batch(rng: random.Random, block_size: int) -> list[ScheduledSequence]:
    seqs = []
    for i in range(rng.randint(1, 6)):
        pos = rng.randint(0, 80)
        blocks = rng.sample(range(200), pos // block_size + 1 + rng.randint(0, 2))
        seqs.append(ScheduledSequence(f"r{i}", [rng.randrange(1000)], pos, blocks,
                                      rng.random() < 0.8, GREEDY))
    return seqs


def _fields(inputs: ModelInputs) -> dict[str, object]:
    meta = inputs.meta
    return {"input_ids": inputs.input_ids.tolist(), "positions": inputs.positions.tolist(),
            "sample_indices": inputs.sample_indices.tolist(),
            "sample_seq_indices": list(inputs.sample_seq_indices),
            "slot_mapping": meta.slot_mapping.tolist(),
            "query_start_loc": meta.query_start_loc.tolist(),
            "seq_lens": meta.seq_lens.tolist(), "block_tables": meta.block_tables.tolist(),
            "dtypes": [t.dtype for t in (inputs.input_ids, inputs.positions,
                                         inputs.sample_indices, meta.slot_mapping,
                                         meta.query_start_loc, meta.seq_lens,
                                         meta.block_tables)],
            "scalars": (meta.block_size, meta.max_query_len, meta.max_seq_len,
                        meta.query_start_loc_list, meta.seq_lens_list, meta.write_rows)}


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_inputs_equal_the_whole_array_path(block_size: int) -> None:
    rng = random.Random(block_size)
    for _ in range(200):
        seqs = _decode_batch(rng, block_size)
        assert _fields(build_decode_inputs(seqs, block_size, CPU)) == _fields(
            build_packed_inputs(seqs, block_size, CPU))


def test_a_pass_with_a_prompt_chunk_padding_or_drafts_takes_the_whole_array_path() -> None:
    decode = ScheduledSequence("d", [5], 16, [0, 1], True, GREEDY)
    chunk = ScheduledSequence("c", [1, 2, 3], 0, [2], True, GREEDY)
    pad = ScheduledSequence("p", [7], 3, [3], True, GREEDY, padding=True)
    for seqs in ([decode, chunk], [decode, pad]):
        assert _fields(build_inputs(seqs, 16, CPU)) == _fields(
            build_packed_inputs(seqs, 16, CPU))
    assert build_packed_inputs([decode, pad], 16, CPU).meta.write_rows is not None


def test_a_decode_whose_block_table_is_short_is_refused_by_name() -> None:
    short = ScheduledSequence("short", [5], 16, [0], True, GREEDY)
    with pytest.raises(ValueError, match="sequence short needs 2 blocks for 17 tokens"):
        build_decode_inputs([short], 16, CPU)
    with pytest.raises(ValueError, match="sequence short needs 2 blocks for 17 tokens"):
        build_packed_inputs([short], 16, CPU)
