"""What a router knows of a prompt: its block count and the prefix cache's chained block hashes
(for routing by shared prefix)."""

from __future__ import annotations

from collections.abc import Sequence

from everystop.core.block_pool import BlockHash, hash_block_tokens
from everystop.routing.load import RouteRequest


def route_request(token_ids: Sequence[int], block_size: int, *,
                  with_hashes: bool = True) -> RouteRequest:
    """The `RouteRequest` of a prompt, as the Ray Serve router and the fleet simulator both
    build it (one function, so the two score the same request the same).

    It needs the blocks of its prompt plus the slot of its first sampled token: what it holds
    from its first decode on. `with_hashes=False` skips the hashes for a policy that ignores
    them (only prefix-affinity reads them)."""
    return RouteRequest(kv_blocks_needed=-(-(len(token_ids) + 1) // block_size),
                        prefix_hashes=prefix_block_hashes(token_ids, block_size)
                        if with_hashes else (),
                        num_prompt_tokens=len(token_ids))


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[BlockHash, ...]:
    """The hash of each full block of `token_ids`, chained as the prefix cache chains them
    (block i's hash covers blocks 0..i), so equal leading blocks give equal leading hashes.

    NOTE: `hash_block_tokens` is Python's `hash`, stable within one process (the router keeps
    its own map) but not promised across processes: never compare hashes from two processes.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return tuple(hashes)
