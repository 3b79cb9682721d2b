"""Paged attention over a flat packed batch: K/V are written to and read from the block pool
through per-sequence block tables.

Layout of the KV pool (one per layer)::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot s lives at block s // block_size, offset s % block_size

A step's tokens are packed back to back, sequence after sequence (no padding)::

    q: [num_tokens, num_heads, head_dim]
    query_start_loc: [num_seqs + 1]   tokens of seq i are q[qsl[i]:qsl[i+1]]
    seq_lens: [num_seqs]              context length of seq i *after* this step
    block_tables: [num_seqs, max_blocks] physical block ids (padding entries are never read)

Token j of sequence i sits at position seq_lens[i] - qlen_i + j and attends to positions
0..that position (causal, its cached prefix included); with a sliding window W, to positions
p-W+1..p only::

    positions  0 ........ p-W+1 ....... p
    blocks     [ wholly before ][ in the window ]
               never read: the KV manager may free them

NOTE (contract with the KV cache manager): under a window, block-table entries of logical
blocks lying wholly before p-W+1 (for the sequence's first query of the step) are never
dereferenced by any implementation, so they may hold freed or reused block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from everystop.executor.layers.attention_torch import paged_attention_torch
from everystop.executor.layers.cpu_kernels import CACHE_DTYPES, CpuKernels

# ModelConfig.attention_backend: "auto" = the CPU kernel where it applies, else pure torch;
# "kernel" (an error where it cannot run), "torch" or "reference" force one implementation.
BACKENDS = ("auto", "kernel", "torch", "reference")


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    seq_lens: torch.Tensor  # [num_seqs] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so per-sequence Python loops need no device sync.
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    # Rows whose K/V are stored; None = every row (only static padding rows are left out).
    write_rows: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    def for_rows(self, rows: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
        """The metadata that attends only the query rows `rows` (sorted token indices) of this
        batch, each as a one-token query over its sequence's cache up to and including itself.
        Used once every row's K/V is written, by a layer whose other rows' outputs are unused."""
        seq_of_row = torch.searchsorted(self.query_start_loc, rows, right=True) - 1
        seq_lens = positions[rows] + 1
        seq_lens_list = seq_lens.tolist()
        n = len(seq_lens_list)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[rows],
            query_start_loc=torch.arange(n + 1, dtype=self.query_start_loc.dtype,
                                         device=rows.device),
            seq_lens=seq_lens, block_tables=self.block_tables[seq_of_row],
            block_size=self.block_size, max_query_len=1 if n else 0,
            max_seq_len=max(seq_lens_list, default=0),
            query_start_loc_list=list(range(n + 1)), seq_lens_list=seq_lens_list)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor,
             write_rows: torch.Tensor | None = None) -> None:
    """Store this step's K/V ([num_tokens, num_kv_heads, head_dim]) into their slots (only
    the rows in `write_rows`, when given)."""
    num_blocks, block_size, kvh, d = key_cache.shape
    if key.dtype != key_cache.dtype:  # a 16-bit cache under fp32 activations
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    if write_rows is not None:
        slot_mapping, key, value = slot_mapping[write_rows], key[write_rows], value[write_rows]
    key_cache.view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, key)
    value_cache.view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, value)


def paged_attention_reference(q: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float, window: int = 0, softcap: float = 0.0
                              ) -> torch.Tensor:
    """Straightforward per-sequence attention: the correctness reference for faster kernels.

    It gathers each sequence's K/V slots into a temporary, which is the cost the fast kernels
    avoid; use it in tests, not on the hot path.
    """
    _, num_heads, head_dim = q.shape
    _, block_size, kvh, _ = key_cache.shape
    group = num_heads // kvh
    out = torch.empty_like(q)
    k_flat = key_cache.view(-1, kvh, head_dim)
    v_flat = value_cache.view(-1, kvh, head_dim)
    qsl = meta.query_start_loc_list
    for i, seq_len in enumerate(meta.seq_lens_list):
        q_start, q_end = qsl[i], qsl[i + 1]
        qlen = q_end - q_start
        n_blocks = (seq_len + block_size - 1) // block_size
        # Under a window only the blocks from the first query's window on are read.
        first = max(0, seq_len - qlen - window + 1) // block_size if window else 0
        blocks = meta.block_tables[i, first:n_blocks]
        slots = (blocks[:, None] * block_size
                 + torch.arange(block_size, device=q.device)[None, :]).reshape(-1)
        slots = slots[:seq_len - first * block_size]
        k = k_flat.index_select(0, slots).repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_flat.index_select(0, slots).repeat_interleave(group, dim=1)
        qi = q[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", qi, k.float()) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
        k_pos = torch.arange(first * block_size, seq_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]
        if window:
            mask |= k_pos[None, :] <= q_pos[:, None] - window
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out


def select_backend(q: torch.Tensor, key_cache: torch.Tensor, kernels: CpuKernels | None,
                   backend: str = "auto") -> str:
    """Which implementation paged_attention runs for these inputs: "kernel", "torch" or
    "reference"."""
    usable = (kernels is not None and kernels.handles(q) and kernels.handles(key_cache)
              and key_cache.dtype in CACHE_DTYPES)
    if backend == "auto":
        return "kernel" if usable else "torch"
    if backend == "kernel" and not usable:
        raise RuntimeError(f"attention backend 'kernel' cannot run these inputs (device "
                           f"{q.device}, cache dtype {key_cache.dtype}, CPU kernels "
                           f"{kernels.isa if kernels else 'off'})")
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}; expected one of {BACKENDS}")
    return backend


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, kernels: CpuKernels | None = None,
                    backend: str = "auto", window: int = 0, softcap: float = 0.0
                    ) -> torch.Tensor:
    """Attention for a packed batch through the block tables (see select_backend); returns
    q's dtype. `window` > 0: a sliding window (see the module's NOTE); `softcap` > 0: scores
    become softcap * tanh(scores / softcap) before the mask."""
    chosen = select_backend(q, key_cache, kernels, backend)
    if chosen == "kernel":
        assert kernels is not None
        return kernels.paged_attention(q, key_cache, value_cache, meta.block_tables,
                                       meta.query_start_loc, meta.seq_lens, scale, window,
                                       softcap)
    if chosen == "torch":
        return paged_attention_torch(q, key_cache, value_cache, meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc_list,
                                     meta.seq_lens_list, scale, window, softcap)
    return paged_attention_reference(q, key_cache, value_cache, meta, scale, window, softcap)
