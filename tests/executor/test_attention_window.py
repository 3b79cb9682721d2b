"""Sliding-window and soft-capped paged attention: every implementation against dense attention
written out here, and the contract with the KV manager: under a window, the block-table
entries of blocks lying wholly before a sequence's window are never dereferenced."""

from __future__ import annotations

import pytest
import torch

from everystop.executor.layers import cpu_kernels
from everystop.executor.layers.attention import paged_attention, paged_attention_reference

from .test_paged_attention import MIXED, make_batch

_BEST = cpu_kernels.load_cpu_kernels("auto")
# The pure-torch path, the reference, and this CPU's best kernel build.
IMPLS = ("torch", "reference", *(("kernel",) if _BEST is not None else ()))
WINDOWED = [(1, 1), (40, 1), (300, 1), (33, 1), (70, 24), (64, 64), (97, 31), (250, 5)]


def _run(impl: str, q, kc, vc, meta, scale, window, softcap) -> torch.Tensor:
    if impl == "kernel":
        return paged_attention(q, kc, vc, meta, scale, _BEST, "kernel", window, softcap)
    return paged_attention(q, kc, vc, meta, scale, None, impl, window, softcap)


def _dense(q, kc, vc, meta, scale, window, softcap) -> torch.Tensor:
    """Attention from each sequence's gathered K/V and an explicit position mask."""
    bs, kvh, d = kc.shape[1], kc.shape[2], kc.shape[3]
    group = q.shape[1] // kvh
    out = torch.empty_like(q, dtype=torch.float32)
    qsl = meta.query_start_loc_list
    for i, n in enumerate(meta.seq_lens_list):
        slots = [int(meta.block_tables[i, p // bs]) * bs + p % bs for p in range(n)]
        k = kc.view(-1, kvh, d)[slots].float().repeat_interleave(group, dim=1)
        v = vc.view(-1, kvh, d)[slots].float().repeat_interleave(group, dim=1)
        qi = q[qsl[i]:qsl[i + 1]].float()
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(n - qi.shape[0], n)[:, None]
        kpos = torch.arange(n)[None, :]
        hidden = (kpos > qpos) | ((kpos <= qpos - window) if window else False)
        s = s.masked_fill(hidden[None], float("-inf"))
        out[qsl[i]:qsl[i + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("window", "softcap"), [(16, 0.0), (37, 0.0), (0, 2.0), (20, 3.0)])
@pytest.mark.parametrize("heads", [(8, 2, 64), (6, 2, 40)])
def test_window_and_softcap_match_dense_attention(impl, window, softcap, heads):
    h, kvh, d = heads
    q, kc, vc, meta = make_batch(WINDOWED, h, kvh, d, 16, torch.float32, seed=h + window)
    scale = d ** -0.5
    out = _run(impl, q, kc, vc, meta, scale, window, softcap)
    torch.testing.assert_close(out, _dense(q, kc, vc, meta, scale, window, softcap),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_before_the_window_are_never_read(impl, dtype):
    """Entries of blocks wholly before each sequence's first query's window become ids out of
    the pool, and the blocks they named hold NaN: the outputs must not change."""
    h, kvh, d, bs, window = 8, 2, 64, 16, 20
    q, kc, vc, meta = make_batch(WINDOWED, h, kvh, d, bs, dtype, seed=5)
    scale = d ** -0.5
    expected = paged_attention_reference(q, kc, vc, meta, scale, window)
    qsl = meta.query_start_loc_list
    freed = 0
    for i, n in enumerate(meta.seq_lens_list):
        first_query = n - (qsl[i + 1] - qsl[i])
        for b in range(max(0, first_query - window + 1) // bs):
            kc[meta.block_tables[i, b]] = float("nan")
            vc[meta.block_tables[i, b]] = float("nan")
            meta.block_tables[i, b] = kc.shape[0] + 1000 + b
            freed += 1
    assert freed >= 10
    out = _run(impl, q, kc, vc, meta, scale, window, 0.0)
    torch.testing.assert_close(out.float(), expected.float(),
                               **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else
                                  dict(rtol=2e-2, atol=2e-2)))


def test_no_window_is_the_unwindowed_kernel():
    """window 0 and softcap 0 compute what the plain op computes (the mixed batch of
    test_paged_attention)."""
    q, kc, vc, meta = make_batch(MIXED, 8, 2, 64, 16, torch.float32, seed=1)
    plain = paged_attention(q, kc, vc, meta, 0.125, _BEST, "auto")
    assert torch.equal(_run("kernel" if _BEST else "torch", q, kc, vc, meta, 0.125, 0, 0.0),
                       plain)
