"""Paged KV-cache bookkeeping: a block allocator with reference counts and prefix caching.

Only full blocks of committed tokens are cached. A cached block is identified by a hash chain
(parent block's hash, this block's token ids), so a hit means the whole prefix matches. Blocks
whose reference count drops to zero go to a free queue in LRU order but stay findable by hash
until they are handed out again (that is when a cached block is evicted).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


def kv_slot(table, pos, block_size: int, rows=None, last_block: int | None = None):
    """KV slot of position ``pos``: table[pos // bs] * bs + pos % bs. Ints through a list, or arrays and
    tensors through a 2-D table (``rows``: each position's row; ``last_block`` clamps padding positions)."""
    blk = pos // block_size
    if last_block is not None:
        blk = blk.clamp(max=last_block)
    return (table[blk] if rows is None else table[rows, blk]) * block_size + pos % block_size


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())  # (8 bytes an id: one C call, not a str per id)
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass
class BlockStats:
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits: int = 0  # prompt tokens found cached
    evictions: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.stats = BlockStats()
        # with speculation: which blocks have draft KV (a request taking others catches up over them)
        self.require_draft_kv = False
        self.draft_ready = [False] * num_blocks

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Cached full blocks at the start of ``token_ids``, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return [], []
        max_blocks = (len(token_ids) - 1) // self.block_size
        ids: list[int] = []
        hashes: list[bytes] = []
        parent = None
        for b in range(max_blocks):
            h = hash_block(parent, token_ids[b * self.block_size : (b + 1) * self.block_size])
            bid = self.cached.get(h)
            if bid is None:
                break
            parent = h
            ids.append(bid)
            hashes.append(h)
        self.stats.prefix_queries += len(token_ids)
        self.stats.prefix_hits += len(ids) * self.block_size
        return ids, hashes

    def take_cached(self, block_ids: list[int]) -> None:
        """Add a reference to blocks found by match_prefix (they may be in the free queue)."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_cnt == 0:
                del self.free_queue[bid]
            blk.ref_cnt += 1

    def cache_blocks(self, block_table: list[int], block_hashes: list[bytes], token_ids: Sequence[int],
                     num_committed: int) -> None:
        """Register the full blocks of ``block_table`` holding committed tokens (extends block_hashes)."""
        if not self.enable_prefix_caching:
            return
        num_full = num_committed // self.block_size
        parent = block_hashes[-1] if block_hashes else None
        for b in range(len(block_hashes), num_full):
            h = hash_block(parent, token_ids[b * self.block_size : (b + 1) * self.block_size])
            self.register(block_table[b], h)
            block_hashes.append(h)
            parent = h

    def register(self, block_id: int, h: bytes) -> None:
        """Make a full block of committed tokens findable by its chain hash ``h``."""
        blk = self.blocks[block_id]
        if blk.block_hash is None:
            blk.block_hash = h
            cur = self.cached.get(h)
            # a copy with draft KV beats one without (see mark_draft_ready)
            if cur is None or (self.draft_ready[block_id] and not self.draft_ready[cur]):
                self.cached[h] = block_id

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"need {n} KV blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            blk = self.blocks[bid]
            if blk.block_hash is not None:  # evict it from the prefix cache
                if self.cached.get(blk.block_hash) == bid:
                    del self.cached[blk.block_hash]
                blk.block_hash = None
                self.stats.evictions += 1
            blk.ref_cnt = 1
            self.draft_ready[bid] = False
            out.append(bid)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        # tail blocks first into the queue, so a request's prefix outlives its suffix
        for bid in reversed(block_ids):
            blk = self.blocks[bid]
            if blk.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {bid}")
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if blk.block_hash is None:
                    # uncached blocks are reused first
                    self.free_queue[bid] = None
                    self.free_queue.move_to_end(bid, last=False)
                else:
                    self.free_queue[bid] = None

    def lacks_draft_kv(self, block_ids: Sequence[int]) -> bool:
        """Whether any of these blocks is missing the draft KV a speculating engine needs."""
        return self.require_draft_kv and not all(self.draft_ready[b] for b in block_ids)

    def draft_ready_prefix(self, block_ids: Sequence[int]) -> int:
        """How many leading blocks of these have draft KV."""
        n = 0
        while n < len(block_ids) and self.draft_ready[block_ids[n]]:
            n += 1
        return n

    def mark_draft_ready(self, block_ids: Sequence[int]) -> None:
        for bid in block_ids:
            if self.draft_ready[bid]:  # already marked (and its cached entry settled then)
                continue
            self.draft_ready[bid] = True
            # a block filled while speculation was off stays the cached copy of its prefix, and
            # drafting requests refuse it; this block holds the same tokens with draft KV: cache it
            h = self.blocks[bid].block_hash
            if h is not None:
                cur = self.cached.get(h)
                if cur is not None and cur != bid and not self.draft_ready[cur]:
                    self.cached[h] = bid

    def reset_prefix_cache(self) -> None:
        for blk in self.blocks:
            if blk.ref_cnt == 0:
                blk.block_hash = None
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].block_hash == h}


class WindowBlocks:
    """The KV blocks of sliding-window layers: a pool of their own beside the full-attention layers'.

    A request's ``KVSlots.window_table`` is as long as its block table (position p: slot
    window_table[p // bs] * bs + p % bs), with ``null`` for the blocks that fell out of the window of
    every token still to come (freed at once: ``drop``). A block is out of the window of a token at
    position >= c when all its positions are < c - window + 1 (window 8, bs 4, c = 13: blocks 0..0).
    Freed blocks stay findable by their hash until reused, like the full pool's; a prefix hit needs
    only the last ``hit_blocks`` blocks before the first token to compute.
    """

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.window = window
        self.null = num_blocks  # the spare block past the pool's: masked reads, padded writes
        self.hit_blocks = -(-(window - 1) // block_size)  # a token at c sees positions c - window + 1 .. c - 1

    def drop(self, kv: KVSlots, num_computed: int) -> None:
        """Free the blocks out of the window of every token at positions >= ``num_computed``."""
        t = kv.window_table
        freed = []
        for i in range(min(max(0, num_computed - self.window + 1) // self.block_size, len(t)) - 1, -1, -1):
            if t[i] == self.null:  # (nulls are a prefix: dropped by an earlier call)
                break
            freed.append(t[i])
            t[i] = self.null
        if freed:
            self.pool.free(freed)

    def grow(self, kv: KVSlots, n: int) -> None:
        kv.window_table.extend(self.pool.allocate(n))

    def trim(self, kv: KVSlots, keep: int) -> None:
        """Free the table's blocks past the first ``keep`` (drafts' blocks that were rejected)."""
        self.pool.free([b for b in kv.window_table[keep:] if b != self.null])
        del kv.window_table[keep:]

    def release(self, kv: KVSlots) -> None:
        self.cache(kv)
        self.pool.free([b for b in kv.window_table if b != self.null])
        kv.window_table = []

    def cache(self, kv: KVSlots) -> None:
        """Register the blocks whose hashes the full pool computed (``kv.block_hashes``) since the last call;
        one dropped before (overlap scheduling moves counts before commit) is simply not cached."""
        if not self.pool.enable_prefix_caching:
            return
        t = kv.window_table
        for b in range(kv.window_hashed, min(len(kv.block_hashes), len(t))):
            if t[b] != self.null:
                self.pool.register(t[b], kv.block_hashes[b])
        kv.window_hashed = max(kv.window_hashed, len(kv.block_hashes))

    def match(self, hashes: list[bytes]) -> tuple[int, list[int]]:
        """The longest prefix of these full-pool hits whose last min(n, hit_blocks) blocks are cached
        here: (n blocks, its window table, nulls before them). Takes no reference."""
        cached = self.pool.cached if self.pool.enable_prefix_caching else {}
        n, run = len(hashes), 0  # blocks [n - run, n) are cached
        for i in range(len(hashes) - 1, -1, -1):
            if run >= self.hit_blocks:
                break
            if hashes[i] in cached:
                run += 1
            else:
                n, run = i, 0
        return n, [self.null] * (n - run) + [cached[h] for h in hashes[n - run : n]]


@dataclass
class KVSlots:
    """A request's view of its blocks: block table plus the hashes of its cached full blocks; with
    sliding-window layers their own table (WindowBlocks) and how many of its blocks were registered."""

    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    window_table: list[int] = field(default_factory=list)
    window_hashed: int = 0
