"""Physical KV blocks: ref counts, an O(1) LRU free queue, and the prefix-hash index.

A block is in exactly one of three states::

    used    ref_cnt > 0                       owned by one or more running sequences
    cached  ref_cnt == 0 and block_hash set   free, but its K/V is reusable until evicted
    empty   ref_cnt == 0 and no hash          free

Both free states sit in one LRU queue; taking a block from the head evicts its hash (if any).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# A full block's identity: hash of (parent block's hash, this block's tokens).
BlockHash = int


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    return hash((parent_hash, token_ids))


def adapter_root(lora_id: int) -> BlockHash | None:
    """The parent of a request's first block: None for the base model, a value of the LoRA
    adapter's own otherwise, so the same tokens under two adapters (or under one and the base)
    hash, and match, apart: their K/V differ."""
    return None if lora_id < 0 else hash(("lora adapter", lora_id))


@dataclass(eq=False, slots=True)  # slots: a simulated fleet holds millions of these
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # What the hash stands for, compared on every hit so a hash collision can never hand a
    # sequence someone else's K/V.
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """The device's KV blocks and who may use them."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # map/zip rather than per-item Python loops: a simulated fleet builds millions of these.
        self.blocks = list(map(KVBlock, range(num_blocks)))
        # NOTE: insertion order is eviction order: the head is the least recently freed.
        self._free: OrderedDict[int, KVBlock] = OrderedDict(zip(range(num_blocks), self.blocks))
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0

    # -- counts ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty or cached-and-unreferenced)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self._free.values() if b.block_hash is not None)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    # -- allocation -----------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the LRU head, evicting any cached contents they hold."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks a new sequence reuses."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the queue tail in the given order
        (callers pass a sequence's blocks tail first, so its prefix outlives its suffix)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # -- prefix cache ---------------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash, parent_hash: BlockHash | None,
               token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    def cache_block(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None,
                    token_ids: tuple[int, ...]) -> bool:
        """Register a full, computed block under its hash. False if the hash is already served
        by another block (the duplicate stays private and is recycled normally)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block
        return True

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        self.num_evictions += 1

    # -- invariants -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            in_free = block.block_id in self._free
            if in_free != (block.ref_cnt == 0):
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                                     f"in free queue {in_free}")
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise AssertionError(f"block {block.block_id} has a hash the index lacks")
        for h, block in self._cached.items():
            if block.block_hash != h:
                raise AssertionError(f"index maps {h} to block {block.block_id} with another hash")
