"""Turn the scheduled sequences of one step into the flat packed tensors the model consumes.

All index arithmetic is numpy over whole arrays (no per-token Python loops)::

    seq:        |--- s0: 5 tokens ---|- s1: 1 -|------ s2: 3 ------|
    query_start_loc: 0               5         6                   9
    positions:  start0 .. start0+4    start1    start2 .. start2+2
    slot(t) = block_table[seq(t)][pos(t) // block_size] * block_size + pos(t) % block_size
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from everystop.core.outputs import ScheduledSequence
from everystop.executor.layers.attention import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # Rows of the hidden states to sample, in order: the last row of each sequence with
    # `sample` set, or a speculating row's last 1+k rows (num_draft_tokens = k).
    sample_indices: torch.Tensor  # [N] int64
    sample_seq_indices: list[int]  # index into the scheduled list for each of those rows


def build_inputs(seqs: Sequence[ScheduledSequence], block_size: int,
                 device: torch.device) -> ModelInputs:
    """Pack `seqs` (non-empty) into model inputs on `device`."""
    if all(len(s.token_ids) == 1 and not s.padding and not s.num_draft_tokens for s in seqs):
        return build_decode_inputs(seqs, block_size, device)
    return build_packed_inputs(seqs, block_size, device)


def build_decode_inputs(seqs: Sequence[ScheduledSequence], block_size: int,
                        device: torch.device) -> ModelInputs:
    """`build_packed_inputs` for a pass of one token per sequence (plain decoding, no padding
    rows or drafts), in plain Python: at a few sequences this is ~5x less interpreter work per
    step than the whole-array path, whose ~40 numpy calls run with cold caches after the
    weights have streamed through them."""
    n = len(seqs)
    starts = [s.start_pos for s in seqs]
    seq_lens = [p + 1 for p in starts]
    width = max(max(len(s.block_ids) for s in seqs), 1)
    slots = []
    for s, pos in zip(seqs, starts, strict=True):
        if len(s.block_ids) <= pos // block_size:
            raise ValueError(f"sequence {s.request_id} needs {pos // block_size + 1} blocks for "
                             f"{pos + 1} tokens but its block table has {len(s.block_ids)}")
        slots.append(s.block_ids[pos // block_size] * block_size + pos % block_size)
    sample_seq = [i for i, s in enumerate(seqs) if s.sample]
    qsl = list(range(n + 1))
    # One tensor (one copy to the device) holds them all; each input is a view of it.
    flat = [s.token_ids[0] for s in seqs] + starts + slots + qsl + seq_lens + sample_seq
    for s in seqs:
        flat += s.block_ids
        flat += [0] * (width - len(s.block_ids))
    packed = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
    ids, positions, slot_mapping, query_start_loc, lens, sample_rows, table = packed.split(
        [n, n, n, n + 1, n, len(sample_seq), n * width])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=lens,
        block_tables=table.view(n, width), block_size=block_size, max_query_len=1,
        max_seq_len=max(seq_lens), query_start_loc_list=qsl, seq_lens_list=seq_lens)
    return ModelInputs(ids, positions, meta, sample_rows, sample_seq)


def build_packed_inputs(seqs: Sequence[ScheduledSequence], block_size: int,
                        device: torch.device) -> ModelInputs:
    """Any pass: prompt chunks, decodes, padding rows and verify rows, as whole arrays."""
    lens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
    num_tokens = int(lens.sum())
    qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    input_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs),
                            dtype=np.int64, count=num_tokens)
    seq_of_token = np.repeat(np.arange(len(seqs)), lens)
    positions = np.arange(num_tokens, dtype=np.int64) - qsl[:-1][seq_of_token] + starts[
        seq_of_token]
    seq_lens = starts + lens

    n_blocks = np.fromiter((len(s.block_ids) for s in seqs), dtype=np.int64, count=len(seqs))
    needed = (seq_lens + block_size - 1) // block_size
    if (n_blocks < needed).any():
        bad = int(np.argmax(n_blocks < needed))
        raise ValueError(f"sequence {seqs[bad].request_id} needs {needed[bad]} blocks for "
                         f"{seq_lens[bad]} tokens but its block table has {n_blocks[bad]}")
    table = np.zeros((len(seqs), max(int(n_blocks.max()), 1)), dtype=np.int64)
    flat_blocks = np.fromiter(itertools.chain.from_iterable(s.block_ids for s in seqs),
                              dtype=np.int64, count=int(n_blocks.sum()))
    # Row-major fill of the ragged tables: column index of each block within its row.
    rows = np.repeat(np.arange(len(seqs)), n_blocks)
    cols = np.arange(len(flat_blocks)) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)
    table[rows, cols] = flat_blocks
    slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size
    padding = [i for i, s in enumerate(seqs) if s.padding]
    write_rows = None
    if padding:  # static padding rows are computed but write no K/V (see ScheduledSequence)
        writes = ~np.isin(seq_of_token, padding)
        write_rows = torch.from_numpy(np.flatnonzero(writes)).to(device, non_blocking=True)

    sample_seq = [i for i, s in enumerate(seqs) if s.sample]
    sample_rows = qsl[1:][sample_seq] - 1
    if any(seqs[i].num_draft_tokens for i in sample_seq):  # verify rows: 1+k per such row
        counts = np.fromiter((seqs[i].num_draft_tokens + 1 for i in sample_seq),
                             dtype=np.int64, count=len(sample_seq))
        ends = np.repeat(sample_rows + 1, counts)
        sample_rows = ends - counts.repeat(counts) + (
            np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
        sample_seq = np.repeat(sample_seq, counts).tolist()

    def to_dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=to_dev(slots), query_start_loc=to_dev(qsl), seq_lens=to_dev(seq_lens),
        block_tables=to_dev(table), block_size=block_size, max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()), query_start_loc_list=qsl.tolist(),
        seq_lens_list=seq_lens.tolist(), write_rows=write_rows)
    return ModelInputs(to_dev(input_ids), to_dev(positions), meta,
                       to_dev(np.asarray(sample_rows, dtype=np.int64)), sample_seq)
