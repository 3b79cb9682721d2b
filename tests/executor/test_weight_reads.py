"""layers/weight_reads.pass_bytes: whole weights once, one embedding row per token, the LM head
only when logits were computed (a tied head is the embedding, read whole then), and the
partly-read layers' own reports in place of their weights."""

from __future__ import annotations

import torch

from everystop.executor.layers.weight_reads import WeightReads, pass_bytes

EMBED = torch.zeros(10, 4)  # 10 rows of 16 bytes
HEAD = torch.zeros(10, 4, dtype=torch.uint8)  # 40 bytes
NORM = torch.zeros(4)  # 16 bytes
EXPERTS = torch.zeros(8, 4)  # 128 bytes, reported in part


def _reads(tokens: int, partial: int, logits: bool) -> WeightReads:
    reads = WeightReads()
    reads.begin(99)
    reads.add_partial(1000)  # forgotten by the next begin
    reads.begin(tokens)
    reads.add_partial(partial)
    if logits:
        reads.mark_logits()
    return reads


def test_untied_head_read_only_with_logits():
    weights = [EMBED, NORM, EXPERTS, HEAD]
    with_logits = pass_bytes(_reads(3, 32, True), weights, [EXPERTS], EMBED, HEAD)
    assert with_logits == 16 + 3 * 16 + 32 + 40
    assert pass_bytes(_reads(3, 32, False), weights, [EXPERTS], EMBED, HEAD) == 16 + 48 + 32


def test_tied_head_is_the_whole_embedding():
    reads = _reads(2, 0, True)
    assert pass_bytes(reads, [EMBED, NORM], [], EMBED, EMBED) == 16 + 2 * 16 + 160
