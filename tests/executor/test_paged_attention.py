"""Every paged-attention implementation against the slow reference, on random block pools with
shuffled block tables and mixed batches (decodes, prefill chunks over cached prefixes, and
whole prompts)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from everystop.executor.layers import cpu_kernels
from everystop.executor.layers.attention import (
    AttentionMetadata,
    paged_attention,
    paged_attention_reference,
    select_backend,
    write_kv,
)

# Every kernel build this CPU can execute (on an AVX-512 machine the AVX2 and generic builds
# too), and the pure-torch path.
IMPLS = ("torch", *(f"kernel-{isa}" for isa in cpu_kernels.runnable_isas()))
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def make_batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, seed: int):
    """seqs: (context length after the step, query tokens this step) per sequence. Returns
    q, key_cache, value_cache, meta with every sequence's blocks scattered through the pool."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n, _ in seqs]
    num_blocks = sum(need) + 3  # a few blocks nobody owns
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    max_blocks = max(need) + 2
    # Padding entries hold garbage (-1 or out-of-range) to prove they are never read.
    tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.long)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
        if n < max_blocks:
            tables[i, n] = num_blocks + 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    qlens = [q for _, q in seqs]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    q = torch.randn((qsl[-1], num_heads, head_dim), generator=gen).to(dtype)
    slots = []
    for i, (n, ql) in enumerate(seqs):
        for pos in range(n - ql, n):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.long),
        seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.long),
        block_tables=tables, block_size=block_size, max_query_len=max(qlens),
        max_seq_len=max(n for n, _ in seqs), query_start_loc_list=qsl,
        seq_lens_list=[n for n, _ in seqs])
    return q, key_cache, value_cache, meta


MIXED = [(1, 1), (17, 1), (300, 1), (33, 1), (40, 24), (64, 64), (97, 31), (16, 1), (250, 5)]


def run(impl: str, *args) -> torch.Tensor:
    if impl.startswith("kernel-"):
        kernels = cpu_kernels.load_cpu_kernels(impl.removeprefix("kernel-"))
        return paged_attention(*args, kernels=kernels, backend="kernel")
    return paged_attention(*args, backend=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# Block sizes that are not a multiple of the kernel's 8- or 16-key tile, and a head_dim that is
# not a multiple of its vector width, take the kernel's partial-tile and padded-copy paths.
@pytest.mark.parametrize("block_size", [16, 24, 32])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (6, 2, 40)])
def test_mixed_batch_matches_reference(impl, dtype, block_size, heads):
    h, kvh, d = heads
    q, kc, vc, meta = make_batch(MIXED, h, kvh, d, block_size, dtype, seed=block_size + h)
    scale = d ** -0.5
    ref = paged_attention_reference(q, kc, vc, meta, scale)
    out = run(impl, q, kc, vc, meta, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("impl", [i for i in IMPLS if i.startswith("kernel-")])
def test_a_head_narrower_than_the_vectors_is_never_read_past(impl):
    """head_dim 40 against 16-wide vectors (8-wide divide it): the last slot of the pool's last
    block ends right before memory holding NaN, and the output must still be exact."""
    h, kvh, d, bs = 2, 1, 40, 16
    q, kc, vc, meta = make_batch([(bs, 1)], h, kvh, d, bs, torch.float32, seed=3)
    nb = kc.shape[0]
    meta.block_tables[0, 0] = nb - 1  # the sequence fills the pool's last block
    caches = []
    for c in (kc, vc):
        spare = torch.full((nb + 1, *c.shape[1:]), float("nan"))
        spare[:nb] = c
        caches.append(spare[:nb])  # contiguous, followed in memory by a NaN block
    ref = paged_attention_reference(q, *caches, meta, d ** -0.5)
    out = run(impl, q, *caches, meta, d ** -0.5)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@settings(max_examples=20, deadline=None)
@given(data=st.data(), impl=st.sampled_from(IMPLS),
       heads=st.sampled_from([(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 48), (6, 2, 40)]),
       block_size=st.sampled_from([8, 16, 24, 32]), dtype=st.sampled_from([torch.float32,
                                                                      torch.bfloat16]))
def test_random_batches_match_reference(data, impl, heads, block_size, dtype):
    n_seqs = data.draw(st.integers(1, 6))
    seqs = []
    for _ in range(n_seqs):
        ctx = data.draw(st.integers(1, 200))
        seqs.append((ctx, data.draw(st.integers(1, ctx))))
    h, kvh, d = heads
    q, kc, vc, meta = make_batch(seqs, h, kvh, d, block_size, dtype, seed=data.draw(
        st.integers(0, 2**16)))
    scale = d ** -0.5
    ref = paged_attention_reference(q, kc, vc, meta, scale)
    out = run(impl, q, kc, vc, meta, scale)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_reads_what_write_kv_wrote():
    """A prefill written through write_kv and then a decode over it: the cached prefix is
    what the new token attends to, in every implementation."""
    h, kvh, d, bs = 9, 3, 64, 16
    q, kc, vc, meta = make_batch([(37, 37)], h, kvh, d, bs, torch.float32, seed=5)
    kc.zero_()
    vc.zero_()
    gen = torch.Generator().manual_seed(6)  # the same K/V every run, as q's seed gives q
    k_new = torch.randn(37, kvh, d, generator=gen)
    v_new = torch.randn(37, kvh, d, generator=gen)
    write_kv(kc, vc, k_new, v_new, meta.slot_mapping)
    # Dense causal attention over the written K/V, computed without any block table.
    k = k_new.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    v = v_new.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, is_causal=True, scale=d ** -0.5).transpose(0, 1)
    for impl in ("reference",) + IMPLS:
        out = run(impl, q, kc, vc, meta, d ** -0.5)
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_auto_picks_the_best_build_this_cpu_runs():
    kernels = cpu_kernels.load_cpu_kernels("auto")
    assert kernels is not None and kernels.isa == cpu_kernels.runnable_isas()[0]
    q, kc, _, _ = make_batch([(5, 1)], 2, 1, 8, 16, torch.float32, seed=0)
    assert select_backend(q, kc, kernels) == "kernel"
    assert select_backend(q, kc, None) == "torch"


def test_isa_flags_decide_what_runs():
    avx2_only = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "sse2"})
    names = cpu_kernels.runnable_isas(avx2_only)
    assert names[-1] == "generic" and "avx512" not in names and "avx512bf16" not in names
    assert cpu_kernels.runnable_isas(frozenset()) == ["generic"]


def test_build_failure_falls_back_to_torch(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_libraries", {})
    monkeypatch.setattr(cpu_kernels, "_SOURCES", [cpu_kernels._CSRC / "missing.cpp"])
    with caplog.at_level("WARNING"):
        kernels = cpu_kernels.load_cpu_kernels("auto")
        assert cpu_kernels.load_cpu_kernels("auto") is None  # tried once per ISA, not again
    assert kernels is None
    assert sum("unavailable" in r.message for r in caplog.records) == len(
        cpu_kernels.runnable_isas())
    q, kc, vc, meta = make_batch([(20, 3), (9, 1)], 4, 2, 16, 16, torch.float32, seed=1)
    out = paged_attention(q, kc, vc, meta, 0.25, kernels)
    torch.testing.assert_close(out, paged_attention_reference(q, kc, vc, meta, 0.25))
    with pytest.raises(RuntimeError):
        paged_attention(q, kc, vc, meta, 0.25, kernels, backend="kernel")
    with pytest.raises(RuntimeError):
        cpu_kernels.load_cpu_kernels("generic")


def test_unknown_backend_and_isa_are_rejected():
    q, kc, vc, meta = make_batch([(5, 1)], 2, 1, 8, 16, torch.float32, seed=0)
    with pytest.raises(ValueError):
        paged_attention(q, kc, vc, meta, 1.0, backend="triton")
    with pytest.raises(ValueError):
        cpu_kernels.load_cpu_kernels("sse9")


@pytest.mark.parametrize("impl", IMPLS)
def test_unwritten_slots_are_never_used(impl):
    """The KV pool is not zero-filled (kv_pool.py): NaN in every slot no sequence has written
    (block tails, unowned blocks) must not reach any output."""
    h, kvh, d, bs = 8, 2, 64, 16
    q, kc, vc, meta = make_batch(MIXED, h, kvh, d, bs, torch.float32, seed=3)
    ref = paged_attention_reference(q, kc, vc, meta, d ** -0.5)
    written = torch.zeros(kc.shape[0] * bs, dtype=torch.bool)
    for i, n in enumerate(meta.seq_lens_list):
        for pos in range(n):
            written[int(meta.block_tables[i, pos // bs]) * bs + pos % bs] = True
    for cache in (kc, vc):
        cache.view(-1, kvh, d)[~written] = float("nan")
    out = run(impl, q, kc, vc, meta, d ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
