"""The prefix cache's registrations hash each block from its own tokens and its parent's hash,
whichever way the blocks were computed: a prompt at once, one decode token at a time, after a
lookup that hashed ahead, after a recompute preemption. `cache_computed_blocks` makes the
hashes it lacks itself (the simulator's hot path); they must be the chain a lookup makes."""

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
