"""A pass's rows keep the KV manager's block-id list itself (no copy per row per pass): that is
safe only if the manager never changes a list it has handed out. Growth, adopting a cached
prefix, freeing and swapping must leave an earlier pass's table as it was, while the next
table shows the change."""

from everystop.core.kv_cache_manager import KVCacheManager
from everystop.core.request import Request
from everystop.sampling_params import SamplingParams

BS = 4


def _computed(kv: KVCacheManager, req: Request, n: int) -> None:
    assert kv.allocate(req, n)
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req)


def test_growth_replaces_the_table_a_row_holds() -> None:
    kv = KVCacheManager(32, BS)
    req = Request("a", list(range(6)), SamplingParams(max_tokens=20))
    _computed(kv, req, 6)
    row_table = kv.block_ids("a")
    before = list(row_table)
    assert len(before) == 2
    req.output_token_ids.extend([50, 51, 52])
    _computed(kv, req, 3)  # 9 tokens: a third block
    assert row_table == before  # the earlier pass's row still reads its own table
    grown = kv.block_ids("a")
    assert grown[:2] == before and len(grown) == 3
    assert kv.block_ids("a") is grown  # no new list while nothing changes


def test_adopting_a_cached_prefix_replaces_the_table() -> None:
    kv = KVCacheManager(32, BS)
    first = Request("a", list(range(9)), SamplingParams(max_tokens=4))
    _computed(kv, first, 9)
    second = Request("b", list(range(9)) + [99], SamplingParams(max_tokens=4))
    cached = kv.get_computed_blocks(second)
    assert len(cached) == 2
    assert kv.allocate(second, 0)  # an empty table before the prefix is adopted
    empty = kv.block_ids("b")
    assert kv.allocate(second, 2, cached)
    assert empty == []
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]


def test_freeing_and_swapping_leave_a_held_table_alone() -> None:
    kv = KVCacheManager(32, BS, num_cpu_blocks=8)
    req = Request("a", list(range(7)), SamplingParams(max_tokens=4))
    _computed(kv, req, 7)
    row_table = kv.block_ids("a")
    before = list(row_table)
    kv.swap_out(req)
    assert row_table == before and kv.block_ids("a") == []
    kv.swap_in(req, 1)
    assert row_table == before
    swapped_in = kv.block_ids("a")
    kv.free(req)
    assert row_table == before and len(swapped_in) == 2
    assert kv.block_ids("a") == []


def test_growth_in_bulk_leaves_the_held_table_and_the_next_one_is_made_when_asked() -> None:
    # grow_by_one_block (a decode stretch's rows) drops the id list; block_ids() makes the new
    # one, and allocate() after such growth extends the whole table, not the dropped list.
    kv = KVCacheManager(32, BS)
    req = Request("a", list(range(8)), SamplingParams(max_tokens=20))
    _computed(kv, req, 8)
    row_table = kv.block_ids("a")
    before = list(row_table)
    kv.grow_by_one_block([req])
    assert row_table == before
    grown = kv.block_ids("a")
    assert grown == [b.block_id for b in kv.req_blocks["a"]] and len(grown) == 3
    assert kv.block_ids("a") is grown
    kv.check_integrity({"a"})
    req.output_token_ids.extend([50] * 4)
    req.num_computed_tokens = 12
    kv.grow_by_one_block([req])  # four blocks, the list dropped again
    req.output_token_ids.extend([51] * 6)
    assert kv.allocate(req, 6)  # 18 tokens: a fifth block, through the general path
    assert kv.block_ids("a") == [b.block_id for b in kv.req_blocks["a"]]
    assert len(kv.block_ids("a")) == 5 and row_table == before
    kv.check_integrity({"a"})
