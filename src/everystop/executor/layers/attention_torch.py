"""Pure-torch paged attention: the fallback for devices without a dedicated kernel (CUDA, or
CPU when the C++ kernel could not be built).

Single-token (decode) sequences are batched into one padded gather + two batched matmuls, so a
decode step costs a handful of kernel launches whatever the batch size; sequences with several
query tokens (prefill chunks) are done one by one. Scores and accumulation are fp32.
"""

from __future__ import annotations

import torch


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   n_blocks: int, first_block: torch.Tensor | None = None) -> torch.Tensor:
    """[S, n_blocks * block_size, kv_heads, dim] K or V of the rows of block_tables (the
    entries before `first_block` [S], where given, read as block 0)."""
    _, block_size, kvh, d = cache.shape
    table = block_tables[:, :n_blocks]
    # NOTE: table entries past a sequence's last block are padding and may hold anything, and
    # those wholly before a sliding window may be freed, so they are redirected to block 0
    # (its values are masked out below).
    used = (seq_lens[:, None] + block_size - 1) // block_size
    index = torch.arange(n_blocks, device=table.device)[None, :]
    valid = index < used
    if first_block is not None:
        valid &= index >= first_block[:, None]
    table = torch.where(valid, table, torch.zeros_like(table))
    return cache[table].reshape(table.shape[0], n_blocks * block_size, kvh, d)


def _zero_unwritten(v: torch.Tensor, seq_lens: torch.Tensor,
                    first_pos: torch.Tensor | None = None) -> torch.Tensor:
    """V rows at positions >= each sequence's length (and, where given, before `first_pos`
    [S]: blocks redirected by _gather_blocks) set to 0, in place (v is a fresh gather).

    NOTE: the KV pool is not zero-filled (kv_pool.py), so slots past a sequence's length may
    hold NaN bit patterns; their softmax weight is exactly 0, but 0 * NaN is NaN in the
    matmul. K needs no cleaning: its garbage scores are overwritten with -inf before softmax.
    """
    pos = torch.arange(v.shape[1], device=v.device)[None, :]
    beyond = pos >= seq_lens[:, None]
    if first_pos is not None:
        beyond |= pos < first_pos[:, None]
    return v.masked_fill_(beyond[:, :, None, None], 0)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            scale: float, window: int = 0, softcap: float = 0.0, k_start: int = 0
            ) -> torch.Tensor:
    """q: [S, Q, H, D]; k, v: [S, L, KVH, D] for positions k_start.. ; q_pos: [S, Q] absolute
    positions (key j is visible to a query at position p iff j <= p, and p - j < window where
    window > 0). Returns fp32 [S, Q, H, D]."""
    s, ql, h, d = q.shape
    kvh = k.shape[2]
    group = h // kvh
    # Heads of one kv group are folded into the query axis, so K/V are never repeated.
    qg = q.float().view(s, ql, kvh, group, d).permute(0, 2, 1, 3, 4).reshape(s, kvh, ql * group, d)
    kt = k.float().permute(0, 2, 3, 1)  # [S, KVH, D, L]
    scores = torch.matmul(qg, kt) * scale  # [S, KVH, Q*G, L]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(k_start, k_start + k.shape[1], device=q.device)
    hidden = k_pos[None, None, :] > q_pos[:, :, None]  # [S, Q, L]
    if window > 0:
        hidden |= k_pos[None, None, :] <= q_pos[:, :, None] - window
    hidden = hidden.repeat_interleave(group, dim=1)[:, None]  # [S, 1, Q*G, L]
    scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float().permute(0, 2, 1, 3))  # [S, KVH, Q*G, D]
    return out.view(s, kvh, ql, group, d).permute(0, 2, 1, 3, 4).reshape(s, ql, h, d)


def paged_attention_torch(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc_list: list[int], seq_lens_list: list[int],
                          scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Same contract as attention.paged_attention, with the metadata passed unpacked."""
    block_size = key_cache.shape[1]
    out = torch.empty_like(q)
    qsl = query_start_loc_list
    decode = [i for i in range(len(seq_lens_list)) if qsl[i + 1] - qsl[i] == 1]
    if decode:
        max_len = max(seq_lens_list[i] for i in decode)
        n_blocks = (max_len + block_size - 1) // block_size
        idx = torch.tensor(decode, device=q.device)
        tok = torch.tensor([qsl[i] for i in decode], device=q.device)
        lens = seq_lens.index_select(0, idx).to(torch.long)
        tables = block_tables.index_select(0, idx).to(torch.long)
        first_block = first_pos = None
        if window > 0:
            first_block = (lens - window).clamp(min=0) // block_size
            first_pos = first_block * block_size
        k = _gather_blocks(key_cache, tables, lens, n_blocks, first_block)
        v = _zero_unwritten(_gather_blocks(value_cache, tables, lens, n_blocks, first_block),
                            lens, first_pos)
        res = _attend(q.index_select(0, tok)[:, None], k, v, (lens - 1)[:, None], scale,
                      window, softcap)
        out.index_copy_(0, tok, res[:, 0].to(q.dtype))
    for i, seq_len in enumerate(seq_lens_list):
        start, end = qsl[i], qsl[i + 1]
        qlen = end - start
        if qlen == 1 or qlen == 0:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        # Under a window only the blocks from the first query's window on are read.
        first = max(0, seq_len - qlen - window + 1) // block_size if window > 0 else 0
        table = block_tables[i:i + 1, first:n_blocks].to(torch.long)
        k_start = first * block_size
        k = key_cache[table].flatten(1, 2)[:, :seq_len - k_start]
        v = value_cache[table].flatten(1, 2)[:, :seq_len - k_start]
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)[None]
        out[start:end] = _attend(q[None, start:end], k, v, q_pos, scale, window, softcap,
                                 k_start)[0].to(q.dtype)
    return out
