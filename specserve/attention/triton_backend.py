"""Paged attention in Triton (the GPU backend), graph-friendly.

A *tile* is up to ``block_q`` consecutive query tokens of one request; its rows are those tokens
times the query heads that share one KV head (GQA), so decode (1 token), verify (1+k) and prefill
chunks all run through one kernel. A *work item* is a tile and a range of its keys: one program
per (work item, KV head) reads keys and values through the block table, ``block_n`` keys at a
time, with an online softmax.

Small steps (few tiles: decode at low batch) would leave most of the GPU idle, so the plan splits
each tile's keys over several work items (flash-decoding); those write partial outputs with
their log-sum-exp, and a second kernel merges them. Tiles with one work item write the output
directly.

Masking is per query token, from three numbers the plan writes:
  ``kv_limit``   keys at positions >= kv_limit are never seen (causal: own position + 1),
  ``tree_start`` keys below it are the committed prefix, always visible,
  ``tree_bits``  bit i set: the token sees the request's i-th new token (key tree_start + i).
A causal token has tree_start = kv_limit, so its bits are never consulted. A request with a tree
mask has kv_limit = seq_len and tree_start = seq_len - q_len for all its tokens (trees of at most
64 tokens: the bits are one int64). A sliding-window layer's launch (``window``) also hides keys at
positions <= p - window from a query at position p, positions as plain decoding holds them: a causal
token's is kv_limit - 1; a tree token's tree_start + its depth (its row's set bits - 1), and a tree
key's tree_start + the rank of its bit in the querying row (its depth: ancestors precede descendants).

Exact trees (``exact_trees``, on by default): each tree token is a tile of its own that reads its keys
as plain decoding will hold them once its path is committed (the prefix, then its ancestors at
consecutive positions: key ``tree_start + r`` is the node of the r-th set bit of its row, from a path
table built once a step), over the key ranges a one-token decode step takes, so greedy tree speculation
is lossless in bf16. ``share_tree_prefix``: ranges wholly below the tree are read by tiles of several
tree tokens, each token's rows written to its own part slots.

CUDA graphs: ``plan`` writes every per-step number into preallocated device buffers (one packed
host->device copy plus device->device copies; no host sync), and ``forward`` only reads them, so
a graph captured once replays with any step's metadata. A captured launch has a program for every
work item a step of its token count can have; unused programs find ``item_len == 0`` and store
nothing. Steps with exact trees have more items (a tree token's keys split alone) and run the
kernel's EXACT variant, whose programs loop over items up to the count the plan wrote: graphs that
replay such steps are captured with ``capture_exact`` (CUDAGraphRunner's tree graphs, the drafter's
verify graph); the plain variant stays as it was for every other step. Tokens past the step's real
count (padding up to a captured size) write their K/V into ``scratch_slot``.

A window pool (``window_scratch_slot``, kv_cache.WindowBlocks): sliding-window layers write and read
through their own slots and block table, persistent buffers like the others (padding: that pool's
scratch slot).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specserve.attention.base import AttentionBackend, AttentionMetadata, is_fp8, kernel_query, write_kv
from specserve.attention.triton_kernels import merge_kernel, paged_attention_kernel, path_table_kernel
from specserve.engine.host_copy import host_buffer, host_to_device

MAX_TREE_TOKENS = 64  # tree masks are packed into one int64 per token
GRAPH_BLOCK_M = 16  # rows per program for steps of <= LARGE_STEP_TOKENS tokens (all captured sizes)
LARGE_BLOCK_M = 64  # rows per program for larger (prefill-heavy, eager) steps; never split
LARGE_STEP_TOKENS = 512
SMALL_PLAN_TOKENS = 32  # steps of at most this many tokens are planned in plain Python
LOG2E = 1.4426950408889634

# packed int32 metadata sections: per work item, per split tile (merge), per token
_ITEM_FIELDS = ("req", "tok", "len", "lo", "hi", "part", "pstride")
_MERGE_FIELDS = ("tok", "len", "first", "count")
# room for exact trees' one-token tiles beyond a step's usual items: 32 tree tokens x 16 key ranges
# (2048 keys); a step needing more runs its trees as shared tiles (``exact_fallbacks`` counts them)
EXACT_EXTRA_ITEMS = 512


def _pack_rows(mask: np.ndarray) -> np.ndarray:
    """bool [q, q] (q <= 64) -> int64 [q]: bit j of row i set iff mask[i, j]."""
    q = mask.shape[1]
    weights = np.left_shift(np.ones(q, dtype=np.uint64), np.arange(q, dtype=np.uint64))
    return (mask.astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64).view(np.int64)


def _check_trees(trees: dict, q_lens: list[int]) -> None:
    for b, tm in trees.items():
        ql = q_lens[b]
        if tm.dim() == 1 and tm.dtype == torch.int64 and tm.shape[0] == ql:
            pass  # rows already packed as bits (spec.tree.tree_fields)
        elif tuple(tm.shape) != (ql, ql):
            raise ValueError(f"tree mask of request {b} has shape {tuple(tm.shape)}, expected {(ql, ql)}")
        if ql > MAX_TREE_TOKENS:
            raise ValueError(f"tree of request {b} has {ql} tokens; at most {MAX_TREE_TOKENS} are supported")


def _extend(cols: list, first: int, *columns) -> None:
    """Append rows given column-wise (work items from column 0, merges from column 7)."""
    for col, vals in zip(cols[first : first + len(columns)], columns):
        col.extend(vals)


def _capturing(t: torch.Tensor) -> bool:
    """Whether this launch is being recorded into a CUDA graph (then it must cover any step)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _cdiv(a: np.ndarray, b: np.ndarray | int) -> np.ndarray:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _default_target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


class TritonBackend(AttentionBackend):
    """Paged attention with persistent metadata buffers (see the module docstring).

    Capacity is fixed at construction: ``max_num_tokens`` tokens and ``max_num_seqs`` requests
    per step, ``max_blocks_per_seq`` block-table entries per request. ``scratch_slot`` is a
    cache slot no request owns (the runner reserves one block for it); padded tokens write there.
    Steps of fewer tokens than ``split_tiles = target_programs / kv_heads`` split each tile's keys
    into ranges of at least ``min_split_keys`` (``split_kv=False`` turns that off). ``exact_trees``
    (default on; ``--no-exact-tree-attention`` turns it off) runs tree tokens as plain decoding
    of their paths would (module docstring).
    """

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, scale: float, *,
                 num_heads: int, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 scratch_slot: int | None = None, block_n: int = 64, num_warps: int = 4,
                 num_stages: int | None = 2, split_kv: bool = True, target_programs: int | None = None,
                 min_split_keys: int | None = None, exact_trees: bool | None = None,
                 share_tree_prefix: bool | None = None, window_scratch_slot: int | None = None) -> None:
        super().__init__(kv_caches, block_size, scale)
        k0 = kv_caches[0][0]
        num_blocks, page, self.num_kv_heads, self.head_dim = k0.shape
        if page != block_size:
            raise ValueError(f"cache block size {page} != block_size {block_size}")
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        for kc, vc in kv_caches:
            if kc.stride() != k0.stride() or vc.stride() != k0.stride() or kc.stride(-1) != 1:
                raise ValueError("all K/V caches must share one contiguous layout")
        self.num_heads = num_heads
        self.group = num_heads // self.num_kv_heads
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_slot = num_blocks * block_size - 1 if scratch_slot is None else scratch_slot
        self.block_n = block_n
        self.num_warps = num_warps
        self.num_stages = num_stages  # None: Triton's default (docs/decisions.md: 2 for decode)
        self.device = k0.device
        dev = self.device
        self.split_kv = split_kv
        target = target_programs if target_programs is not None else _default_target_programs(dev)
        self.split_tiles = max(1, -(-target // self.num_kv_heads))  # split below this many tiles
        self.min_split_keys = 128 if min_split_keys is None else min_split_keys  # keys a tile needs to split

        self.exact_trees = exact_trees is not False  # (None: the default, on)
        self.exact_fallbacks = 0  # steps whose trees ran as shared tiles for want of room
        # exact trees: the key ranges below a tree read once by tiles of several of its tokens
        self.share_tree_prefix = share_tree_prefix is not False  # (None: the default, on)
        self._exact_step = False  # the last plan has exact trees: only EXACT launches run it
        self.capture_exact = False  # set while graphs that replay steps with trees are captured

        # capacities: items <= tokens without splits, < 2 * split_tiles with them; exact trees more.
        # Merges: one per split tile or exact tree token, and keys split only below split_tiles tokens
        extra_items = EXACT_EXTRA_ITEMS if self.exact_trees else 0
        self.max_items = max_num_tokens + 2 * self.split_tiles + extra_items
        self.max_parts = 2 * self.split_tiles + extra_items
        self._sections = [self.max_items] * len(_ITEM_FIELDS) + [self.split_tiles] * len(_MERGE_FIELDS) \
            + [max_num_tokens] * 2 + [2]
        self._meta = torch.zeros(sum(self._sections), dtype=torch.int32, device=dev)
        self._offsets = np.cumsum([0] + self._sections).tolist()
        views = self._meta.split(self._sections)
        self._item = dict(zip(_ITEM_FIELDS, views[: len(_ITEM_FIELDS)]))
        self._merge = dict(zip(_MERGE_FIELDS, views[len(_ITEM_FIELDS) : len(_ITEM_FIELDS) + len(_MERGE_FIELDS)]))
        self._kv_limit, self._tree_start, self._counts = views[-3:]
        self._tree_bits = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
        # exact trees: each token's path (bit indices of its row's set bits) and its length, from the
        # bits on the device once a step (layer 0's launch), so captured graphs compute them too
        self._path_tab = torch.zeros(max_num_tokens if self.exact_trees else 1, 64, dtype=torch.int32, device=dev)
        self._path_len = torch.zeros(max_num_tokens if self.exact_trees else 1, dtype=torch.int32, device=dev)
        self._block_table = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._slots = torch.full((max_num_tokens,), self.scratch_slot, dtype=torch.long, device=dev)
        self._slots_used = 0  # rows of _slots the last plan wrote (the rest hold the scratch slot)
        # the window pool's (None: sliding-window layers, if any, share the tables above)
        self.window_scratch_slot = window_scratch_slot
        self._window_block_table = self._window_slots = None
        if window_scratch_slot is not None:
            self._window_block_table = torch.zeros_like(self._block_table)
            self._window_slots = torch.full_like(self._slots, window_scratch_slot)
        bm = self.block_m_for(1)
        self._part_o = torch.zeros(self.max_parts, self.num_kv_heads, bm, self.head_dim, dtype=torch.float32,
                                   device=dev)
        self._part_lse = torch.zeros(self.max_parts, self.num_kv_heads, bm, dtype=torch.float32, device=dev)
        self._pin = dev.type == "cuda"
        self._num_items = 0
        self._num_merges = 0
        # entries of the item and merge columns the last plan wrote: a captured launch reads every
        # item a step of its size may have, so the ones past a plan's own must read as empty (zero)
        self._items_written = 0
        self._merges_written = 0
        self._block_m = bm
        # set by the graph runner while capturing: the fewest tokens a step replaying this graph has
        self.graph_min_tokens = 1

    # -- per step ----------------------------------------------------------------------------
    @property
    def step_exact(self) -> bool:
        """The planned step has exact trees: a graph captured without ``capture_exact`` cannot run it."""
        return self._exact_step

    def block_m_for(self, num_tokens: int) -> int:
        """Rows per program: a pure function of the step's token count, so a graph captured for a
        padded size and the plan of any step that replays it agree."""
        bm = GRAPH_BLOCK_M if num_tokens <= LARGE_STEP_TOKENS else LARGE_BLOCK_M
        return max(bm, next_pow2(self.group))

    def can_split(self, num_tokens: int) -> bool:
        """Steps of fewer tokens than ``split_tiles`` (so fewer tiles too) split their keys."""
        return (self.split_kv and num_tokens < self.split_tiles
                and self.block_m_for(num_tokens) == self._part_o.shape[2])

    def step_slots(self, num_tokens: int) -> torch.Tensor:
        return self._slots[:num_tokens]  # (persistent: a graph reads what each plan writes)

    def plan(self, meta: AttentionMetadata) -> None:
        q_list, s_list = list(meta.query_lens), list(meta.seq_lens)
        B = len(q_list)
        if B == 0 or len(s_list) != B:
            raise ValueError(f"need one seq_len per request: {B} query_lens, {len(s_list)} seq_lens")
        if min(q_list) < 1 or any(s < q for s, q in zip(s_list, q_list)):
            raise ValueError("every request needs query_len >= 1 and seq_len >= query_len")
        T = sum(q_list)
        if T > self.max_num_tokens:
            raise ValueError(f"step has {T} tokens; this backend was sized for {self.max_num_tokens}")
        if B > self.max_num_seqs:
            raise ValueError(f"step has {B} requests; this backend was sized for {self.max_num_seqs}")
        bt = meta.block_tables
        if bt.shape[0] != B or bt.shape[1] > self.max_blocks_per_seq:
            raise ValueError(f"block table {tuple(bt.shape)} does not fit {B} requests x {self.max_blocks_per_seq} blocks")
        if max(s_list) > bt.shape[1] * self.block_size:
            raise ValueError("a seq_len exceeds its block table")
        if meta.slot_mapping.shape[0] != T:
            raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} entries for {T} tokens")
        if (meta.window_block_tables is None) != (self._window_slots is None):
            raise ValueError("a step's window tables and the backend's window pool come together")
        trees = meta.tree_masks or {}
        block_m = self.block_m_for(T)
        # the same work list either way (docs/decisions.md: plain Python below SMALL_PLAN_TOKENS)
        _check_trees(trees, q_list)
        exact = self.exact_trees and bool(trees)
        shifted = meta.seq_shift is not None
        while True:
            if T <= SMALL_PLAN_TOKENS:
                cols, n_parts = self._work_small(q_list, s_list, T, block_m, trees, exact, shifted)
            else:
                cols, n_parts = self._work(np.asarray(q_list, dtype=np.int64), np.asarray(s_list, dtype=np.int64),
                                           trees, T, block_m, exact, shifted)
            ni, nm = len(cols[0]), len(cols[len(_ITEM_FIELDS)])
            if ni <= self.max_items and nm <= self.split_tiles and n_parts <= self.max_parts:
                break
            if not exact:
                raise AssertionError(f"work split out of capacity: {ni} items, {nm} merges")  # a bug, not bad input
            exact = False  # long keys x many tree tokens: shared tiles (close, not bit for bit)
            self.exact_fallbacks += 1
        cols.append([ni, nm])
        self._exact_step = exact
        window = None if meta.window_block_tables is None else (meta.window_slot_mapping, meta.window_block_tables)
        self._write(cols, trees, q_list, bt, meta.slot_mapping, T, ni, nm, block_m, window)
        if meta.seq_shift is not None:  # lengths known on the device only: every token's limits move
            shift = meta.seq_shift.to(torch.int32)
            if B > 1:
                shift = shift.repeat_interleave(host_to_device(q_list, self._meta.device), output_size=T)
            self._kv_limit[:T] += shift
            self._tree_start[:T] += shift

    def _work_small(self, q_lens: list[int], seq_lens: list[int], T: int, block_m: int,
                    trees: dict | None = None, exact: bool = False,
                    shifted: bool = False) -> tuple[list[list[int]], int]:
        """``_work`` for a small step, in plain Python."""
        bq = block_m // self.group
        trees = trees or {}
        kv_limit: list[int] = []
        tree_start: list[int] = []
        tiles = []  # (request, first token, tokens, keys of its last token)
        alone = []  # exact trees: (request, first token, tokens, seq_len)
        start = 0
        for b, (q, sl) in enumerate(zip(q_lens, seq_lens)):
            if b in trees:  # every tree token may see all keys, its bits decide
                lim = [sl] * q
                tree_start.extend([sl - q] * q)
            else:
                lim = list(range(sl - q + 1, sl + 1))
                tree_start.extend(lim)
            kv_limit.extend(lim)
            if exact and b in trees:
                alone.append((b, start, q, sl))
            else:
                for i in range(0, q, bq):
                    n = min(bq, q - i)
                    tiles.append((b, start + i, n, lim[i + n - 1]))
            start += q
        split = self.can_split(T)
        per_tile = -(-self.split_tiles // max(len(tiles), 1))
        bn, msk = self.block_n, self.min_split_keys
        cols: list[list[int]] = [[] for _ in range(len(_ITEM_FIELDS) + len(_MERGE_FIELDS))]
        req, tok, ln, lo, hi, part, pstride, m_tok, m_len, m_first, m_count = cols
        n_parts = 0
        for b, t0, n, end in tiles:
            ns = max(min(per_tile, -(-end // msk)), 1) if split else 1
            chunk = -(-(-(-end // ns)) // bn) * bn
            ns = -(-end // chunk)
            if ns > 1:
                m_tok.append(t0)
                m_len.append(n)
                m_first.append(n_parts)
                m_count.append(ns)
            for j in range(ns):
                req.append(b)
                tok.append(t0)
                ln.append(n)
                lo.append(j * chunk)
                hi.append(min(j * chunk + chunk, end))
                part.append(n_parts if ns > 1 else -1)
                pstride.append(0)
                n_parts += ns > 1
        for b, t0, q, sl in alone:
            n_parts = self._exact_tree(cols, b, t0, q, sl, bq, split, shifted, n_parts)
        cols += [kv_limit, tree_start]
        return cols, n_parts

    def _exact_tree(self, cols: list, b: int, t0: int, q: int, sl: int, bq: int, split: bool, shifted: bool,
                    n_parts: int) -> int:
        """Work items and merges of request b's tree of q tokens (the first t0) under exact trees: its
        keys in the ranges a one-token decode step takes (``128 * split_tiles`` keys at most: the
        split of seq_len, not of the token's own length, is the same 128-key chunks). With
        ``share_tree_prefix`` ranges wholly below the tree are shared by tiles of ``bq`` tokens; the
        rest (all, without it) are per token, its path mapped in. Every
        token merges its own ``C`` partial outputs (part slots ``first + i * C + c``: a shared item
        writes each of its tokens' rows there, ``pstride = C``). Returns the parts used."""
        bn, msk = self.block_n, self.min_split_keys
        ns = max(min(self.split_tiles, -(-sl // msk)), 1) if split else 1
        chunk = -(-(-(-sl // ns)) // bn) * bn
        C = -(-sl // chunk)
        if C == 1:  # one range: each token alone writes its output (a one-range decode step does)
            _extend(cols, 0, [b] * q, range(t0, t0 + q), [1] * q, [0] * q, [sl] * q, [-1] * q, [0] * q)
            return n_parts
        # ranges wholly below the tree; a step planned longer (seq_shift) has its tree up to q keys lower
        below = max(0, sl - q - (q if shifted else 0)) // chunk if self.share_tree_prefix else 0
        if below:  # tiles of bq tokens x the ranges below the tree
            firsts = range(0, q, bq)
            _extend(cols, 0, [b] * (len(firsts) * below), [t0 + i for i in firsts for _ in range(below)],
                    [min(bq, q - i) for i in firsts for _ in range(below)],
                    [c * chunk for c in range(below)] * len(firsts),
                    [(c + 1) * chunk for c in range(below)] * len(firsts),
                    [n_parts + i * C + c for i in firsts for c in range(below)], [C] * (len(firsts) * below))
        tail = C - below  # each token alone x the rest (its path mapped in)
        _extend(cols, 0, [b] * (q * tail), [t0 + i for i in range(q) for _ in range(tail)], [1] * (q * tail),
                [c * chunk for c in range(below, C)] * q, [min((c + 1) * chunk, sl) for c in range(below, C)] * q,
                [n_parts + i * C + c for i in range(q) for c in range(below, C)], [C] * (q * tail))
        _extend(cols, 7, range(t0, t0 + q), [1] * q, range(n_parts, n_parts + q * C, C), [C] * q)
        return n_parts + q * C

    def _work(self, q_lens: np.ndarray, seq_lens: np.ndarray, trees: dict, T: int,
              block_m: int, exact: bool = False, shifted: bool = False) -> tuple[list, int]:
        """The step's work items (tiles of query tokens x key ranges), merges of split tiles, and
        per-token key limits, as the fourteen columns of the metadata buffer (counts apart); and the
        split parts. Exact trees' work comes after every other tile's (``_exact_tree``)."""
        B = len(q_lens)
        bq = block_m // self.group
        starts = np.cumsum(q_lens) - q_lens
        req_of_tok = np.repeat(np.arange(B), q_lens)
        idx_in_req = np.arange(T) - starts[req_of_tok]
        kv_limit = seq_lens[req_of_tok] - q_lens[req_of_tok] + idx_in_req + 1
        tree_start = kv_limit.copy()
        for b in trees:
            ql, sl = int(q_lens[b]), int(seq_lens[b])
            st = int(starts[b])
            kv_limit[st : st + ql] = sl
            tree_start[st : st + ql] = sl - ql

        # tiles: bq consecutive tokens of one request (exact trees' own work apart)
        alone = np.zeros(B, dtype=bool)
        if exact:
            alone[list(trees)] = True
        n_tiles = np.where(alone, 0, (q_lens + bq - 1) // bq)
        tile_req = np.repeat(np.arange(B), n_tiles)
        tile_idx = np.arange(int(n_tiles.sum())) - (np.cumsum(n_tiles) - n_tiles)[tile_req]
        tile_tok = starts[tile_req] + tile_idx * bq
        tile_len = np.minimum(bq, q_lens[tile_req] - tile_idx * bq)
        tile_kv_end = kv_limit[tile_tok + tile_len - 1]  # the tile's last token sees the most keys
        nt = len(tile_req)

        # work items: split the keys of every tile when there are too few tiles to fill the GPU
        split = self.can_split(T)
        n_split = np.ones(nt, dtype=np.int64)
        if split:
            per_tile = -(-self.split_tiles // max(nt, 1))
            n_split = np.clip(np.minimum(per_tile, _cdiv(tile_kv_end, self.min_split_keys)), 1, None)
        chunk = _cdiv(_cdiv(tile_kv_end, n_split), self.block_n) * self.block_n  # keys per item
        n_split = _cdiv(tile_kv_end, chunk)
        item_tile = np.repeat(np.arange(nt), n_split)
        item_idx = np.arange(len(item_tile)) - (np.cumsum(n_split) - n_split)[item_tile]
        item_lo = item_idx * chunk[item_tile]
        item_hi = np.minimum(item_lo + chunk[item_tile], tile_kv_end[item_tile])
        is_split = n_split[item_tile] > 1
        item_part = np.full(len(item_tile), -1, dtype=np.int64)
        item_part[is_split] = np.arange(int(is_split.sum()))
        merged = np.nonzero(n_split > 1)[0]
        merge_count = n_split[merged]
        merge_first = np.cumsum(merge_count) - merge_count
        cols: list = [tile_req[item_tile], tile_tok[item_tile], tile_len[item_tile], item_lo, item_hi, item_part,
                      np.zeros(len(item_tile), dtype=np.int64),
                      tile_tok[merged], tile_len[merged], merge_first, merge_count]
        n_parts = int(is_split.sum())
        if alone.any():  # (a few trees of at most 64 tokens: in Python)
            extra: list[list[int]] = [[] for _ in cols]
            for b in np.nonzero(alone)[0]:
                n_parts = self._exact_tree(extra, int(b), int(starts[b]), int(q_lens[b]), int(seq_lens[b]), bq,
                                           split, shifted, n_parts)
            cols = [np.concatenate([c, np.asarray(e, dtype=np.int64)]) for c, e in zip(cols, extra)]
        return cols + [kv_limit, tree_start], n_parts

    def _write(self, cols: list, trees: dict, q_lens: list[int], bt: torch.Tensor, slot_mapping: torch.Tensor,
               T: int, ni: int, nm: int, block_m: int,
               window: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The planned step into the persistent device buffers (asynchronous copies)."""
        B = len(q_lens)
        offs = self._offsets
        if isinstance(cols[0], list):
            # the small path's entries alone, zeros over what the last plan wrote past them:
            # (index, value) pairs in one copy and a scatter on the device
            idx: list[int] = []
            vals: list[int] = []
            n_items = len(_ITEM_FIELDS)
            for f, (o, col) in enumerate(zip(offs, cols)):
                n = len(col)
                idx.extend(range(o, o + n))
                vals.extend(col)
                stale = (self._items_written if f < n_items else
                         self._merges_written if f < n_items + len(_MERGE_FIELDS) else 0)
                if stale > n:
                    idx.extend(range(o + n, o + stale))
                    vals.extend([0] * (stale - n))
            both = host_to_device(idx + vals, self._meta.device)
            self._meta.index_copy_(0, both[: len(idx)], both[len(idx) :].to(torch.int32))
        else:  # the whole buffer, zeros past every column's entries
            h, host = host_buffer(sum(self._sections), torch.int32, self._meta.device)
            for i, col in enumerate(cols):
                h[offs[i] : offs[i] + len(col)] = col
            self._meta.copy_(host, non_blocking=True)
        self._items_written, self._merges_written = ni, nm

        # tree bits: only tokens of tree requests read theirs, so stale entries elsewhere are harmless
        if trees:
            starts = np.cumsum([0] + q_lens[:-1])
            on_host = all(tm.device.type == "cpu" for tm in trees.values())
            if on_host:  # every tree's rows in one host buffer, one copy
                hb, host_bits = host_buffer(T, torch.int64, self._meta.device)
            for b, tm in trees.items():
                ql, s = int(q_lens[b]), int(starts[b])
                if tm.dim() == 1:  # packed already
                    if on_host:
                        hb[s : s + ql] = tm.numpy()
                    else:
                        self._tree_bits[s : s + ql].copy_(tm, non_blocking=True)
                    continue
                if on_host:
                    hb[s : s + ql] = _pack_rows(tm.numpy().astype(bool))
                    continue
                weights = torch.ones(ql, dtype=torch.int64, device=tm.device).bitwise_left_shift_(
                    torch.arange(ql, dtype=torch.int64, device=tm.device))
                self._tree_bits[s : s + ql].copy_((tm.to(torch.int64) * weights).sum(-1), non_blocking=True)
            if on_host:
                self._tree_bits[:T].copy_(host_bits, non_blocking=True)

        self._block_table[:B, : bt.shape[1]].copy_(bt, non_blocking=True)
        self._slots[:T].copy_(slot_mapping, non_blocking=True)
        if window is not None:
            self._window_block_table[:B, : bt.shape[1]].copy_(window[1], non_blocking=True)
            self._window_slots[:T].copy_(window[0], non_blocking=True)
        if T < self._slots_used:  # padding rows write to the scratch slot (past T: scratch already)
            self._slots[T : self._slots_used].fill_(self.scratch_slot)
            if window is not None:
                self._window_slots[T : self._slots_used].fill_(self.window_scratch_slot)
        self._slots_used = T
        self._num_items = ni
        self._num_merges = nm
        self._block_m = block_m

    # -- per layer ---------------------------------------------------------------------------
    def _graph_grid(self, n: int) -> tuple[int, int]:
        """Programs (work items, merges) of a launch captured for n tokens: every item and merge a
        step of that size has without exact trees (with them, the EXACT programs loop for more)."""
        may_split = self.can_split(self.graph_min_tokens)
        n_items = min(self.max_items, n + 2 * self.split_tiles) if may_split else n
        return n_items, (self.split_tiles if may_split else 0)

    @property
    def supports_fused_rope(self) -> bool:  # type: ignore[override]
        return self.device.type == "cuda"

    def forward_rope(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_heads: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        from specserve.models.triton_ops import rope_and_cache

        kv = self.kv_caches[layer]
        if qkv.dtype != kv[0].dtype and not is_fp8(kv[0].dtype):  # rotary and write apart
            if positions is not None:
                raise ValueError(f"the draft rotary kernel needs qkv in the cache's dtype {kv[0].dtype}, got {qkv.dtype}")
            from specserve.models.layers import rotary_qkv

            return self.forward(layer, *rotary_qkv(qkv, cos, sin, num_heads, self.num_kv_heads, self.head_dim))
        q = rope_and_cache(qkv, cos, sin, kv, self._slots[: qkv.shape[0]], num_heads, self.num_kv_heads,
                           self.head_dim, positions)
        return self._attend(layer, q)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        n = q.shape[0]
        pooled = window is not None and self._window_slots is not None  # (the window pool's layer)
        write_kv(self.kv_caches[layer], (self._window_slots if pooled else self._slots)[:n], k, v)
        return self._attend(layer, q, window)

    def _attend(self, layer: int, q: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """Attention of q [T, H, D] over the cache, this step's K/V already written."""
        k_cache, v_cache = self.kv_caches[layer]
        table = self._window_block_table if window is not None and self._window_slots is not None else self._block_table
        n = q.shape[0]
        q = kernel_query(q, k_cache.dtype)
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        # captured launches cover every work item a step of n tokens can have; eager ones the planned
        if _capturing(q):
            exact = self.capture_exact
            n_items, n_merges = self._graph_grid(n)
        else:
            exact = self._exact_step
            n_items, n_merges = self._num_items, self._num_merges
        it, po, pl = self._item, self._part_o, self._part_lse
        if exact and layer == 0:  # (every model runs its layer 0 first)
            path_table_kernel[(n,)](self._tree_bits, self._path_tab, self._path_len)
        block_d = max(16, next_pow2(self.head_dim))
        extra = {} if self.num_stages is None else {"num_stages": self.num_stages}
        paged_attention_kernel[(n_items, self.num_kv_heads)](
            q, k_cache, v_cache, out, po, pl,
            it["req"], it["tok"], it["len"], it["lo"], it["hi"], it["part"], it["pstride"],
            self._kv_limit, self._tree_start, self._tree_bits, self._path_tab, self._path_len, self._counts,
            table, table.stride(0), self.scale * LOG2E, window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            po.stride(0), po.stride(1),
            G=self.group, BLOCK_M=self._block_m, BLOCK_N=self.block_n,
            HEAD_DIM=self.head_dim, BLOCK_D=block_d, PAGE=self.block_size,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", EXACT=exact, WINDOWED=window is not None,
            num_warps=self.num_warps, **extra,
        )
        if n_merges:
            mg = self._merge
            merge_kernel[(n_merges, self.num_kv_heads)](
                po, pl, out, mg["tok"], mg["len"], mg["first"], mg["count"], self._counts,
                out.stride(0), out.stride(1), po.stride(0), po.stride(1),
                G=self.group, BLOCK_M=self._block_m, HEAD_DIM=self.head_dim, BLOCK_D=block_d, EXACT=exact,
                num_warps=4,
            )
        return out


def max_blocks_per_seq(max_model_len: int, block_size: int, num_blocks: int) -> int:
    return min(num_blocks, math.ceil(max_model_len / block_size))
