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


def test_blocks_without_draft_kv_are_refused_then_replaced_by_a_copy_with_it():
    """A prefix filled while speculation was off has no draft KV: a drafting request recomputes it
    (counted as refused), and once its own copy has draft KV that copy becomes the cached one."""
    bm = BlockManager(8, 4)
    bm.require_draft_kv = True
    toks = list(range(9))  # 2 full blocks + 1 token
    off = bm.allocate(3)
    bm.cache_blocks(off, [], toks, num_committed=9)
    bm.free(off)
    assert bm.match_prefix(toks)[0] == [] and bm.stats.prefix_refused == 8 and bm.stats.prefix_hits == 0
    # a request that will not draft may take them
    assert bm.match_prefix(toks, any_draft_kv=True)[0] == off[:2]
    # the drafting request's own blocks: hashed as it commits, given draft KV by its catch-up
    on = bm.allocate(3)
    bm.cache_blocks(on, [], toks, num_committed=9)
    assert bm.match_prefix(toks)[0] == []  # no draft KV on either copy yet
    bm.mark_draft_ready(on[:2])
    assert bm.match_prefix(toks)[0] == on[:2]
    # draft KV first, hashes after (the catch-up ran before the block filled): the same
    bm2 = BlockManager(8, 4)
    bm2.require_draft_kv = True
    off2 = bm2.allocate(3)
    bm2.cache_blocks(off2, [], toks, num_committed=9)
    on2 = bm2.allocate(3)
    bm2.mark_draft_ready(on2[:2])
    bm2.cache_blocks(on2, [], toks, num_committed=9)
    assert bm2.match_prefix(toks)[0] == on2[:2]
    # evicting the displaced copy leaves the cached one alone
    bm2.free(off2)
    bm2.allocate(5)
    assert bm2.match_prefix(toks)[0] == on2[:2]
