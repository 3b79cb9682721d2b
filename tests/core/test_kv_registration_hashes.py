"""The prefix cache's registrations hash each block from its own tokens and its parent's hash,
whichever way the blocks were computed: a prompt at once, one decode token at a time, after a
lookup that hashed ahead, after a recompute preemption. `cache_computed_blocks` makes the
hashes it lacks itself (the simulator's hot path); they must be the chain a lookup makes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from everystop.core.block_pool import hash_block_tokens
from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.request import Request
from everystop.sampling_params import SamplingParams

BS = 4


def _chain(tokens: list[int]) -> list[int]:
    hashes: list[int] = []
    for i in range(len(tokens) // BS):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                        tuple(tokens[i * BS:(i + 1) * BS])))
    return hashes


def _run(kv: KVCacheManager, req: Request, outputs: int) -> None:
    """Prefill the prompt at once, then decode `outputs` tokens, registering after each pass."""
    assert kv.allocate(req, req.num_tokens - req.num_computed_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    for t in range(outputs):
        req.output_token_ids.append(100 + t)
        assert kv.allocate(req, 1)
        req.num_computed_tokens += 1
        kv.cache_computed_blocks(req)


def _registered(kv: KVCacheManager, req: Request) -> list[int | None]:
    return [b.block_hash for b in kv.req_blocks[req.request_id]][:req.num_computed_tokens // BS]


def test_registered_hashes_are_the_lookup_chain() -> None:
    kv = KVCacheManager(64, BS)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=50))
    kv.get_computed_blocks(a)  # hashes its first two blocks ahead of the registration
    _run(kv, a, 17)
    tokens = a.prompt_token_ids + a.output_token_ids
    assert _registered(kv, a) == _chain(tokens)
    # The same tokens again: every full block but the last token's is a hit.
    b = Request("b", tokens + [999], SamplingParams(max_tokens=5))
    hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit] == [blk.block_id for blk in kv.req_blocks["a"]][:6]


def test_registration_after_a_recompute_preemption_rehashes_nothing_wrong() -> None:
    kv = KVCacheManager(64, BS)
    a = Request("a", list(range(7)), SamplingParams(max_tokens=50))
    _run(kv, a, 6)
    kv.free(a)  # recompute preemption: the blocks go, the request's hashes stay
    a.num_computed_tokens = 0
    _run(kv, a, 9)
    tokens = a.prompt_token_ids + a.output_token_ids
    # Blocks computed twice are served by their first copy (the second stays private); every
    # full block is found by a lookup of the same tokens, and what is registered is the chain.
    chain = _chain(tokens)
    assert all(h is None or h == c for h, c in zip(_registered(kv, a), chain, strict=True))
    b = Request("b", tokens + [999], SamplingParams(max_tokens=5))
    assert len(kv.get_computed_blocks(b)) == len(tokens) // BS


def _pool_state(kv: KVCacheManager) -> tuple:
    pool = kv.pool
    # (block_ids as asked for: growth leaves the id list to be made when it is)
    return ({r: kv.block_ids(r) for r in kv.req_blocks},
            {r: list(h) for r, h in kv._req_hashes.items()}, dict(kv.registered_blocks),
            list(pool._free),
            {h: b.block_id for h, b in pool._cached.items()}, pool.num_evictions,
            [(b.ref_cnt, b.block_hash, b.parent_hash, b.token_ids) for b in pool.blocks])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 11)), min_size=1, max_size=6),
       st.integers(0, 30), st.sampled_from([24, 40, 200]))
def test_bulk_growth_and_registration_are_the_row_by_row_calls(prompts, steps, num_blocks) -> None:
    # A decode stretch grows and registers the rows at a block boundary in one call each
    # (grow_by_one_block, cache_next_blocks): the pool must end exactly as with allocate(req, 1)
    # and cache_computed_blocks per row in running order (shared prefixes: duplicate hashes;
    # a small pool: evictions of cached blocks).
    one, bulk = KVCacheManager(num_blocks, BS), KVCacheManager(num_blocks, BS)
    rows = {kv: [Request(f"q{i}", [7 * family] * 5 + list(range(n)),
                         SamplingParams(max_tokens=100)) for i, (family, n) in enumerate(prompts)]
            for kv in (one, bulk)}
    for kv in (one, bulk):
        for req in rows[kv]:
            if not kv.allocate(req, req.num_tokens):
                return  # the prompts alone overflow this pool: nothing to compare
            req.num_computed_tokens = req.num_tokens
            kv.cache_computed_blocks(req)
    for t in range(steps):
        boundary = [k for k, r in enumerate(rows[one])
                    if r.num_computed_tokens == len(one.req_blocks[r.request_id]) * BS]
        if len(boundary) > one.pool.num_free_blocks:
            break
        for k in boundary:
            assert one.allocate(rows[one][k], 1)
        bulk.grow_by_one_block([rows[bulk][k] for k in boundary])
        for kv in (one, bulk):
            for req in rows[kv]:
                req.output_token_ids.append(500 + t)
                req.num_computed_tokens += 1
        for req in rows[one]:
            one.cache_computed_blocks(req)
        bulk.cache_next_blocks([r for r in rows[bulk] if r.num_computed_tokens % BS == 0])
        assert _pool_state(one) == _pool_state(bulk)
    for kv in (one, bulk):
        kv.forget(rows[kv][0])
    assert _pool_state(one) == _pool_state(bulk)


def test_bulk_growth_refuses_a_row_not_at_a_block_boundary() -> None:
    kv = KVCacheManager(16, BS)
    req = Request("a", list(range(6)), SamplingParams(max_tokens=5))
    assert kv.allocate(req, 6)
    req.num_computed_tokens = 6
    free = kv.pool.num_free_blocks
    with pytest.raises(ValueError, match="block boundary"):
        kv.grow_by_one_block([req])
    assert kv.pool.num_free_blocks == free  # nothing taken
