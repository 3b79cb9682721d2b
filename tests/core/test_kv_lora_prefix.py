"""The prefix cache keys blocks by LoRA adapter as well as tokens: the same tokens under
another adapter, or under the base, never match (their K/V differ); under the same adapter they
do, through the prompt path and the one-block decode path alike."""

import pytest

from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.request import Request
from everystop.sampling_params import SamplingParams

BS = 4
TOKENS = list(range(13))


def _computed(kv: KVCacheManager, rid: str, lora_id: int, decode: int = 0) -> Request:
    """A request of TOKENS under `lora_id`, prefilled (then `decode` tokens decoded one at a
    time through cache_next_blocks) and its blocks registered."""
    req = Request(rid, list(TOKENS), SamplingParams(max_tokens=50), lora_id=lora_id)
    assert kv.allocate(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    for t in range(decode):
        req.output_token_ids.append(100 + t)
        assert kv.allocate(req, 1)
        req.num_computed_tokens += 1
        kv.cache_next_blocks([req])
    return req


def _hits(kv: KVCacheManager, lora_id: int, tokens: list[int] = TOKENS) -> int:
    probe = f"probe{lora_id}-{len(tokens)}"  # its own id: a request's hashes are kept by id
    return len(kv.get_computed_blocks(Request(probe, list(tokens),
                                              SamplingParams(max_tokens=1), lora_id=lora_id)))


@pytest.mark.parametrize("owner", [-1, 0, 7])
def test_only_the_same_adapter_hits(owner: int) -> None:
    kv = KVCacheManager(64, BS)
    _computed(kv, "a", owner)
    for lora_id in (-1, 0, 1, 7):
        assert _hits(kv, lora_id) == (3 if lora_id == owner else 0), lora_id


def test_decoded_blocks_are_keyed_by_adapter_too() -> None:
    kv = KVCacheManager(64, BS)
    req = _computed(kv, "a", 2, decode=7)  # 20 tokens: blocks 4 registered by decode
    tokens = req.prompt_token_ids + req.output_token_ids + [0]
    assert _hits(kv, 2, tokens) == 5
    assert _hits(kv, 3, tokens) == 0
