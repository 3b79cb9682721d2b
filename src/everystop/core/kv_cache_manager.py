"""Per-request block tables on top of the block pool: allocate on demand, free at once (and,
under a sliding window, release what the window has passed), reuse cached prefixes, and keep
the books for swapping to host memory."""

from __future__ import annotations

from everystop.core.block_pool import (
    BlockHash,
    BlockPool,
    KVBlock,
    adapter_root,
    hash_block_tokens,
)
from everystop.core.request import Request
from everystop.core.sliding_window import SlidingWindow


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, *, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.02,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: the tokens every layer's queries attend back over (None when any
        layer attends to the whole context); blocks behind it are released as sequences run."""
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.window = None if sliding_window is None else SlidingWindow(sliding_window,
                                                                        block_size)
        # NOTE: a released entry of a block table holds the null block, so that logical block
        # i stays entry i of the table (positions map to slots as before). The null block is
        # the device's last block, kept out of the pool: never handed out, never written, never
        # swapped, so a kernel that gathers whole tables reads only values the window masks.
        # Released entries are always a leading run of the table (`_num_released`, kept while
        # the request is swapped out too).
        self.null_block: KVBlock | None = None
        if self.window is not None:
            if num_gpu_blocks < 2:
                raise ValueError("a sliding window needs at least two device blocks")
            num_gpu_blocks -= 1
            self.null_block = KVBlock(num_gpu_blocks)
        self._num_released: dict[str, int] = {}
        self.pool = BlockPool(num_gpu_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        # New admissions must leave this many blocks free, so running sequences can always grow
        # (or at least a preemption can complete) without the pool hitting zero.
        self.watermark_blocks = 0
        self.set_watermark(watermark)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # The same tables as plain block ids, kept in step, or absent until block_ids() asks
        # after grow_by_one_block (a decode stretch grows tables nobody reads in the meantime).
        # NOTE: a list here is never changed once made (growth replaces or drops it), so
        # block_ids() hands it out as the snapshot a pass's row keeps, without copying it for
        # every row of every pass.
        self._req_block_ids: dict[str, list[int]] = {}
        # Hashes of the request's full blocks (prompt and output), computed once each.
        self._req_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of the request are registered in the prefix cache (read by the
        # scheduler's per-row loop to skip the rows with nothing to register; changed only here).
        self.registered_blocks: dict[str, int] = {}
        # Host swap space: a plain free list of host block ids.
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.swapped_blocks: dict[str, list[int]] = {}
        # Host blocks released by a swap-in are reusable only from the next step: the executor
        # performs this step's swap-outs before its swap-ins.
        self._cpu_release_next_step: list[int] = []
        # Counters. Lookups count every try (a request may be looked up again while it waits);
        # the token counters count once per admission, in tokens as vLLM does.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_gpu_blocks(self) -> int:
        return self.pool.num_blocks

    def set_watermark(self, watermark: float) -> None:
        """The fraction of the pool new admissions must leave free (hot-reloadable)."""
        self.watermark_blocks = int(watermark * self.num_gpu_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_pass_tokens: int) -> int:
        """The most device blocks a sequence of num_tokens holds at once, when no pass carries
        more than max_pass_tokens of it (all of them, without a sliding window)."""
        if self.window is None:
            return self.blocks_needed(num_tokens)
        return self.window.max_blocks_held(num_tokens, max_pass_tokens)

    def num_held_blocks(self, request_id: str) -> int:
        """Device blocks the request holds now (its table less the released entries)."""
        return (len(self.req_blocks.get(request_id, ()))
                - self._num_released.get(request_id, 0))

    def num_released_blocks(self, request_id: str) -> int:
        """Leading entries of the request's table its window has passed (kept while it is
        swapped out: they come back as released)."""
        return self._num_released.get(request_id, 0)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as it is now: a list the manager never changes later
        (callers must not change it either)."""
        ids = self._req_block_ids.get(request_id)
        if ids is None:
            blocks = self.req_blocks.get(request_id)
            if blocks is None:
                return []
            ids = self._req_block_ids[request_id] = [b.block_id for b in blocks]
        return ids

    # -- prefix cache ---------------------------------------------------------------------------
    def _block_hashes(self, req: Request, num_full_blocks: int) -> list[BlockHash]:
        hashes = self._req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else adapter_root(req.lora_id)
            hashes.append(hash_block_tokens(parent, tuple(req.token_slice(i * bs, (i + 1) * bs))))
        return hashes

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The longest run of cached blocks matching the start of the request's tokens.

        NOTE: at least one token is always left to compute, since sampling needs its logits.
        """
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        self.num_prefix_queries += 1
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hashes = self._block_hashes(req, max_blocks)
        hit: list[KVBlock] = []
        for i in range(max_blocks):
            parent = hashes[i - 1] if i else adapter_root(req.lora_id)
            tokens = tuple(req.token_slice(i * bs, (i + 1) * bs))
            block = self.pool.lookup(hashes[i], parent, tokens)
            if block is None:
                if self.window is None:
                    break
                hit.append(self._no_block)
                continue
            hit.append(block)
        if self.window is not None:
            hit = self._hit_in_window(hit)
        if hit:
            self.num_prefix_hits += 1
        return hit

    # A miss in a windowed lookup (never returned: _hit_in_window cuts or masks it).
    _no_block = KVBlock(-1)

    def _hit_in_window(self, found: list[KVBlock]) -> list[KVBlock]:
        """The blocks a windowed sequence adopts from one lookup per block (misses are
        _no_block): the longest hit whose blocks within the window of its end are all
        cached, with the null block for those before the window (core/sliding_window.py).
        NOTE: every hit was checked against the request's own hash chain, which commits to
        its whole prefix, so the blocks missing before the window do not weaken the match."""
        assert self.window is not None and self.null_block is not None
        n = self.window.longest_hit([b is not self._no_block for b in found])
        first = self.window.first_live_block(n * self.block_size)
        return [self.null_block] * first + found[first:n]

    def count_prefix_use(self, req: Request, num_hit_blocks: int) -> None:
        """Count an admitted request's prefix lookup in tokens: its tokens queried, and those
        its `num_hit_blocks` cached blocks spared (called once per admission that looked up)."""
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return  # no lookup was made (see get_computed_blocks)
        self.num_prefix_query_tokens += req.num_tokens
        self.num_prefix_hit_tokens += num_hit_blocks * self.block_size

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's blocks that are now full and computed, so others can reuse
        them (called after each step that advanced the request)."""
        if not self.enable_prefix_caching:
            return
        # Most calls (a decode inside a block) register nothing: answer those first, cheaply.
        rid, bs = req.request_id, self.block_size
        start = self.registered_blocks.get(rid, 0)
        num_full = req.num_computed_tokens // bs
        if num_full <= start:
            return
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        if num_full > len(blocks):
            num_full = len(blocks)
            if num_full <= start:
                return
        # NOTE: the hashes of blocks not hashed yet are made here, from the same token tuples
        # the pool keeps (one slice per block, not two): what _block_hashes would compute. The
        # slice (Request.token_slice) is inlined: this runs once per block a request fills.
        hashes = self._req_hashes.get(rid)
        if hashes is None or len(hashes) < start:
            hashes = self._block_hashes(req, start)  # those registered are hashed already
        cache_block, null = self.pool.cache_block, self.null_block
        prompt, output = req.prompt_token_ids, req.output_token_ids
        num_prompt = len(prompt)
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else adapter_root(req.lora_id)
            lo, hi = i * bs, (i + 1) * bs
            if hi <= num_prompt:
                tokens = tuple(prompt[lo:hi])
            elif lo >= num_prompt:
                tokens = tuple(output[lo - num_prompt:hi - num_prompt])
            else:
                tokens = tuple(prompt[lo:] + output[:hi - num_prompt])
            if i == len(hashes):
                hashes.append(hash_block_tokens(parent, tokens))
            if blocks[i] is not null:  # a released entry (after a swap-in): nothing to keep
                cache_block(blocks[i], hashes[i], parent, tokens)
        self.registered_blocks[rid] = num_full

    def cache_next_blocks(self, reqs: list[Request]) -> None:
        """cache_computed_blocks for each request in turn, where each has just filled one block
        past those registered (a decode stretch's rows at a block boundary): the same
        registrations in the same order, the per-call lookups made once."""
        if not self.enable_prefix_caching:
            return
        if self.window is not None:  # a row may hold released entries: the general path
            for req in reqs:
                self.cache_computed_blocks(req)
            return
        bs, registered, held, all_hashes = (self.block_size, self.registered_blocks,
                                            self.req_blocks, self._req_hashes)
        cache_block = self.pool.cache_block
        for req in reqs:
            rid = req.request_id
            i = registered.get(rid, 0)
            blocks = held.get(rid)
            hashes = all_hashes.get(rid)
            if (req.num_computed_tokens // bs != i + 1 or not blocks or len(blocks) <= i
                    or hashes is None or len(hashes) != i):
                self.cache_computed_blocks(req)  # not the one-block case: the general path
                continue
            lo = i * bs
            tokens = tuple(req.token_slice(lo, lo + bs))
            parent = hashes[i - 1] if i else adapter_root(req.lora_id)
            h = hash_block_tokens(parent, tokens)
            hashes.append(h)
            cache_block(blocks[i], h, parent, tokens)
            registered[rid] = i + 1

    # -- allocation -----------------------------------------------------------------------------
    def grow_by_one_block(self, reqs: list[Request]) -> None:
        """Each request's table grows by one block, in turn: what allocate(req, 1) does for
        each when its blocks are exactly full (a decode stretch's rows at a block boundary),
        the pool's blocks taken in one go. The caller has checked that the pool holds them."""
        bs, held, held_ids = self.block_size, self.req_blocks, self._req_block_ids
        for req in reqs:
            blocks = held.get(req.request_id)
            if blocks is None or req.num_computed_tokens != len(blocks) * bs:
                raise ValueError(f"{req.request_id}: not at a block boundary of its table")
        for req, block in zip(reqs, self.pool.get_new_blocks(len(reqs))):
            rid = req.request_id
            held[rid].append(block)
            held_ids.pop(rid, None)  # made again when asked for (see block_ids)

    def num_new_blocks_needed(self, req: Request, num_new_tokens: int,
                              computed: list[KVBlock] = ()) -> int:  # type: ignore[assignment]
        held = len(self.req_blocks.get(req.request_id, ())) + len(computed)
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        return max(0, self.blocks_needed(total) - held)

    def can_allocate(self, req: Request, num_new_tokens: int,
                     computed: list[KVBlock] = (),  # type: ignore[assignment]
                     reserve_watermark: bool = False,
                     max_pass_tokens: int | None = None) -> bool:
        """Whether the pool holds room for num_new_tokens more tokens after `computed`; with
        max_pass_tokens, for those tokens run in passes of at most that many, which under a
        sliding window release blocks as they go."""
        need = self.num_new_blocks_needed(req, num_new_tokens, computed)
        if max_pass_tokens is not None and self.window is not None:
            total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
            need = min(need, self.window.max_blocks_held(total, max_pass_tokens))
        need += self._taken_from_free(computed)
        reserve = self.watermark_blocks if reserve_watermark else 0
        return need <= self.pool.num_free_blocks - reserve

    def allocate(self, req: Request, num_new_tokens: int,
                 computed: list[KVBlock] = (),  # type: ignore[assignment]
                 reserve_watermark: bool = False) -> bool:
        """Grow the request's table to hold num_new_tokens more tokens (after `computed`, the
        cached prefix blocks it adopts). Returns False, changing nothing, if the pool is short."""
        # NOTE: the simulator's hot path: can_allocate's arithmetic inlined, computed once.
        held_blocks = self.req_blocks.get(req.request_id)
        held = len(held_blocks) if held_blocks is not None else 0
        bs = self.block_size
        if not computed and held_blocks is not None and (
                req.num_computed_tokens + num_new_tokens <= held * bs):
            return True  # fits in the blocks it holds: the common decode step
        total = req.num_computed_tokens + len(computed) * bs + num_new_tokens
        need = max(0, -(-total // bs) - held - len(computed))
        taken = need + self._taken_from_free(computed) if computed else need
        reserve = self.watermark_blocks if reserve_watermark else 0
        if taken > self.pool.num_free_blocks - reserve:
            return False
        blocks = self.req_blocks.setdefault(req.request_id, [])
        added: list[KVBlock] = []
        if computed:
            released = computed.count(self.null_block) if self.null_block is not None else 0
            if released:  # the window passed these already: the leading entries, null
                if blocks:
                    raise ValueError(f"{req.request_id}: a windowed prefix adopted mid-table")
                self._num_released[req.request_id] = released
            self.pool.touch(list(computed[released:]))
            added.extend(computed)
            blocks.extend(computed)
            self.registered_blocks[req.request_id] = len(blocks)
        if need:
            new = self.pool.get_new_blocks(need)
            added.extend(new)
            blocks.extend(new)
        ids = self._req_block_ids.get(req.request_id)
        if ids is None:  # new, or dropped by growth: made from the table
            self._req_block_ids[req.request_id] = [b.block_id for b in blocks]
        elif added:  # a new id list: the old one may be a row of a pass (see block_ids)
            self._req_block_ids[req.request_id] = ids + [b.block_id for b in added]
        return True

    def _taken_from_free(self, computed: list[KVBlock]) -> int:
        """Cached blocks among `computed` that are free now: adopting them takes them out of
        the free pool (the null block is never in it)."""
        null = self.null_block
        return sum(1 for b in computed if b.ref_cnt == 0 and b is not null)

    def release_behind_window(self, req: Request, next_pos: int) -> None:
        """Release the request's blocks that no query at next_pos or later reads (sliding
        window only; call as its computed tokens advance). Blocks registered in the prefix
        cache stay reusable, as cached free blocks, until evicted."""
        if self.window is None:
            return
        rid = req.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        first = min(self.window.first_live_block(next_pos), len(blocks))
        done = self._num_released.get(rid, 0)
        if first <= done:
            return
        gone = blocks[done:first]
        assert self.null_block is not None
        blocks[done:first] = [self.null_block] * (first - done)
        self._num_released[rid] = first
        self._req_block_ids.pop(rid, None)  # made again when asked for (see block_ids)
        self.pool.free_blocks(gone[::-1])

    def trim(self, req: Request, num_tokens: int) -> None:
        """Return the blocks past those num_tokens tokens need (speculative decoding: blocks
        grown for proposals the model rejected). They hold no registered, shared or released
        entry: those all lie within the computed tokens."""
        rid = req.request_id
        blocks = self.req_blocks.get(rid)
        keep = self.blocks_needed(num_tokens)
        if blocks is None or len(blocks) <= keep:
            return
        gone = blocks[keep:]
        del blocks[keep:]
        self._req_block_ids.pop(rid, None)  # made again when asked for (see block_ids)
        self.pool.free_blocks(gone[::-1])

    def free(self, req: Request) -> None:
        """Return the request's device blocks now (tail first, so shared prefixes stay cached
        longest). Also forgets its host copy, if it had one."""
        blocks = self.req_blocks.pop(req.request_id, None)
        self._req_block_ids.pop(req.request_id, None)
        released = self._num_released.pop(req.request_id, 0)
        if blocks:
            self.pool.free_blocks(blocks[released:][::-1])
        self.registered_blocks.pop(req.request_id, None)
        host = self.swapped_blocks.pop(req.request_id, None)
        if host:
            self._cpu_free.extend(host)

    def forget(self, req: Request) -> None:
        """Drop everything kept for a finished request."""
        self.free(req)
        self._req_hashes.pop(req.request_id, None)

    # -- swap -----------------------------------------------------------------------------------
    @property
    def num_swapped_blocks(self) -> int:
        return sum(len(h) for h in self.swapped_blocks.values())

    def can_swap_out(self, req: Request) -> bool:
        return self.num_held_blocks(req.request_id) <= len(self._cpu_free)

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to host space: returns (device, host) copies to perform
        before the next forward pass; the device blocks are free from now on. Only entries
        holding computed tokens are copied: released entries come back as released, and
        those grown for tokens not computed yet (written by no pass) as room again."""
        rid = req.request_id
        released = self._num_released.get(rid, 0)
        blocks = self.req_blocks.pop(rid)[released:]
        self._req_block_ids.pop(rid, None)
        num_copies = min(len(blocks), self.blocks_needed(req.num_computed_tokens) - released)
        host = [self._cpu_free.pop() for _ in range(num_copies)]
        self.swapped_blocks[rid] = host
        mapping = [(b.block_id, h) for b, h in zip(blocks, host)]
        self.pool.free_blocks(blocks[::-1])
        self.registered_blocks.pop(rid, None)
        return mapping

    def can_swap_in(self, req: Request, num_new_tokens: int) -> bool:
        return self._swap_in_blocks(req, num_new_tokens) <= (self.pool.num_free_blocks
                                                              - self.watermark_blocks)

    def _swap_in_blocks(self, req: Request, num_new_tokens: int) -> int:
        """Device blocks a swap-in takes: the copies, or room for the new tokens if more."""
        rid = req.request_id
        released = self._num_released.get(rid, 0)
        total = req.num_computed_tokens + num_new_tokens
        return max(released + len(self.swapped_blocks[rid]), self.blocks_needed(total)) - released

    def swap_in(self, req: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """Bring a swapped request back: returns (host, device) copies, and room for
        num_new_tokens more tokens."""
        rid = req.request_id
        new = self.pool.get_new_blocks(self._swap_in_blocks(req, num_new_tokens))
        host = self.swapped_blocks.pop(rid)
        released = self._num_released.get(rid, 0)
        blocks = new
        if released:
            assert self.null_block is not None
            blocks = [self.null_block] * released + new
        self.req_blocks[rid] = blocks
        self._req_block_ids[rid] = [b.block_id for b in blocks]
        self._cpu_release_next_step.extend(host)
        return [(h, b.block_id) for h, b in zip(host, new)]

    def begin_step(self) -> None:
        """Called at the start of each schedule(): host blocks read by last step's swap-ins
        may be reused now."""
        if self._cpu_release_next_step:
            self._cpu_free.extend(self._cpu_release_next_step)
            self._cpu_release_next_step.clear()

    # -- invariants -----------------------------------------------------------------------------
    def check_integrity(self, live_request_ids: set[str] | None = None) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        null = self.null_block
        for rid, blocks in self.req_blocks.items():
            ids = self._req_block_ids.get(rid)
            if ids is not None and ids != [b.block_id for b in blocks]:
                raise AssertionError(f"{rid}: block id list out of step with its table")
            released = self._num_released.get(rid, 0)
            for i, b in enumerate(blocks):
                if (b is null) != (i < released):
                    raise AssertionError(f"{rid}: entry {i} is {'' if b is null else 'not '}"
                                         f"released, but {released} leading entries are")
                if b is not null:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
        if set(self._num_released) - set(self.req_blocks) - set(self.swapped_blocks):
            raise AssertionError("released entries counted for a request holding no blocks")
        for block in self.pool.blocks:
            if refs.get(block.block_id, 0) != block.ref_cnt:
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                                     f"{refs.get(block.block_id, 0)} tables hold it")
        host = [h for hs in self.swapped_blocks.values() for h in hs]
        all_host = host + self._cpu_free + self._cpu_release_next_step
        if len(all_host) != len(set(all_host)) or len(all_host) != self.num_cpu_blocks:
            raise AssertionError("host swap blocks leaked or owned twice")
        if live_request_ids is not None:
            stale = (set(self.req_blocks) | set(self.swapped_blocks)) - live_request_ids
            if stale:
                raise AssertionError(f"blocks held by finished or unknown requests: {stale}")
