import pytest

from specserve.engine.kv_cache import BlockManager, NoFreeBlocksError


def test_allocate_free_refcounts():
    bm = BlockManager(4, 4)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2)
    bm.free(a)
    assert bm.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        bm.free([a[0]])


def test_prefix_cache_hit_shares_blocks_and_keeps_last_token():
    bm = BlockManager(8, 4)
    toks = list(range(10))  # 2 full blocks + 2 tokens
    table = bm.allocate(3)
    hashes: list[bytes] = []
    bm.cache_blocks(table, hashes, toks, num_committed=10)
    assert len(hashes) == 2
    ids, hs = bm.match_prefix(toks)
    assert ids == table[:2] and hs == hashes
    bm.take_cached(ids)
    assert bm.blocks[table[0]].ref_cnt == 2
    # a prompt that is exactly 2 blocks long reuses only 1: one token must be computed
    ids2, _ = bm.match_prefix(toks[:8])
    assert ids2 == table[:1]
    # diverging second block: only the first matches (hash chain)
    ids3, _ = bm.match_prefix(toks[:4] + [99, 98, 97, 96, 1])
    assert ids3 == table[:1]


def test_freed_cached_blocks_stay_findable_until_evicted():
    bm = BlockManager(3, 2)
    toks = [5, 6, 7, 8, 9]
    table = bm.allocate(3)
    h: list[bytes] = []
    bm.cache_blocks(table, h, toks, num_committed=4)
    bm.free(table)
    assert bm.num_free_blocks == 3
    assert bm.match_prefix(toks)[0] == table[:2]
    # uncached block 2 is handed out first; then the tail cached block is evicted before the head
    first = bm.allocate(1)
    assert first == [table[2]]
    second = bm.allocate(1)
    assert second == [table[1]] and bm.stats.evictions == 1
    assert bm.match_prefix(toks)[0] == table[:1]


def test_blocks_without_draft_kv_are_matched_and_say_where_their_draft_kv_ends():
    """A prefix filled while nobody drafted has no draft KV: it is matched all the same, and
    ``lacks_draft_kv`` / ``draft_ready_prefix`` tell the scheduler where the head must catch up."""
    bm = BlockManager(8, 4)
    bm.require_draft_kv = True
    toks = list(range(9))  # 2 full blocks + 1 token
    off = bm.allocate(3)
    bm.cache_blocks(off, [], toks, num_committed=9)
    bm.free(off)
    ids = bm.match_prefix(toks)[0]
    assert ids == off[:2] and bm.stats.prefix_hits == 8
    assert bm.lacks_draft_kv(ids) and bm.draft_ready_prefix(ids) == 0
    bm.mark_draft_ready(off[:1])
    assert bm.lacks_draft_kv(ids) and bm.draft_ready_prefix(ids) == 1
    bm.mark_draft_ready(off[1:2])
    assert not bm.lacks_draft_kv(ids) and bm.draft_ready_prefix(ids) == 2
