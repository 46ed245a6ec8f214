"""The EAGLE-2 tree expansion on static buffers, replayed as CUDA graphs on the GPU.

The eager expansion (``EagleSpeculator._draft_tree``) reads every depth's candidates back to the
host (a sync per depth) and grows its attention buffers as it goes. Here the whole expansion runs
on the device from the numbers written once per engine step:

    h0[b]           the head's output at request b's last committed position (from the catch-up)
    base_pos[b]     the position of depth-2 nodes (= num_tokens - 1); depth d runs at base + d - 2,
                    and the request's committed draft KV is its first base_pos[b] positions
    block_tables[b] its block table (the draft KV shares the target's tables)

Depth 1 takes the ``topk`` best tokens of h0's logits. Each later depth runs the head once over
the frontier (``topk`` nodes per request, all at the same position), takes each node's ``topk``
best children (topk^2 candidates) and keeps the ``topk`` best by cumulative log-probability as the
next frontier. Every candidate is written out (token, score, parent); the host reads them in one
transfer and picks each request's tree with ``select_tree``, the same selection the eager path
makes (it may stop expanding early when deeper nodes can no longer enter; this path always runs
every depth: fixed shapes are what a graph replays).

Attention: a frontier node sees its request's committed draft KV (gathered from the paged cache
once per expansion: the first ``width`` blocks of every block-table row, masked by base_pos, with
``width`` the batch's longest prefix rounded up to a power of two: a graph per (padded batch,
width)) and, among the tree nodes, itself and its ancestors. Tree
nodes' K/V live in a dense buffer, never in the paged cache, so the expansion leaves nothing behind.
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Callable, Sequence

import numpy as np

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionBackend, forward_context
from specserve.engine.host_copy import host_buffer, host_to_device
from specserve.models.eagle3 import Eagle3DraftModel
from specserve.spec.draft_graph import GraphStats, batch_buckets, capture_each
from specserve.spec.tree import Candidate, accept_trees, select_trees, tree_fields, tree_width


def width_buckets(max_blocks: int, smallest: int = 8) -> list[int]:
    """Block-table widths the expansion's graphs gather: powers of two up to max_blocks, and max_blocks."""
    sizes = []
    w = smallest
    while w < max_blocks:
        sizes.append(w)
        w *= 2
    return sizes + [max_blocks]


def candidate_depths(topk: int, depth: int) -> list[int]:
    """Depth of each candidate slot: topk at depth 1, then topk^2 per depth up to ``depth``."""
    return [1] * topk + [d for d in range(2, depth + 1) for _ in range(topk * topk)]


class StaticTreeAttention(AttentionBackend):
    """Attention of one depth's frontier: committed draft KV (paged) + ancestors and self (dense)."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, scale: float,
                 max_batch: int, topk: int, depth: int) -> None:
        super().__init__(kv_caches, block_size, scale)
        self.topk = topk
        nodes = max(depth - 1, 1) * topk  # tree queries over all depths >= 2
        self.tree_k = [k.new_zeros(max_batch, nodes, *k.shape[-2:]) for k, _ in kv_caches]
        self.tree_v = [v.new_zeros(max_batch, nodes, *v.shape[-2:]) for _, v in kv_caches]
        self._prefix: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(kv_caches)
        self._slots: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._at = 0

    def plan(self, meta: Any) -> None:  # pragma: no cover - driven by begin()/set_depth()
        raise NotImplementedError("StaticTreeAttention is driven by begin() and set_depth()")

    def begin(self, block_tables: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
        """Slots of every request's committed draft KV; returns the prefix validity [B, P]."""
        B, W = block_tables.shape
        bs = self.block_size
        j = torch.arange(W * bs, device=block_tables.device)
        slots = block_tables.gather(1, (j // bs)[None].expand(B, -1)) * bs + (j % bs)[None]
        valid = j[None] < prefix_lens[:, None]
        self._slots = torch.where(valid, slots, torch.zeros_like(slots))
        self._prefix = [None] * len(self.kv_caches)  # gathered at each layer's first depth
        return valid

    def set_depth(self, index: int, mask: torch.Tensor) -> None:
        """Depth ``index + 2``: its nodes go to tree columns [index * topk, (index + 1) * topk);
        mask bool [B, topk, P + tree nodes]."""
        self._at = index * self.topk
        self._mask = mask[:, None]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self._slots is not None and self._mask is not None, "begin() and set_depth() first"
        B, K = self._slots.shape[0], self.topk
        h, d = q.shape[1], q.shape[2]
        kvh = k.shape[1]
        if self._prefix[layer] is None:
            kc, vc = self.kv_caches[layer]
            self._prefix[layer] = (kc.view(-1, kvh, d)[self._slots], vc.view(-1, kvh, d)[self._slots])
        pk, pv = self._prefix[layer]
        tk, tv = self.tree_k[layer][:B], self.tree_v[layer][:B]
        tk[:, self._at : self._at + K] = k.view(B, K, kvh, d).to(tk.dtype)
        tv[:, self._at : self._at + K] = v.view(B, K, kvh, d).to(tv.dtype)
        qq = q.view(B, K, h, d).transpose(1, 2)
        kk = torch.cat([pk, tk], 1).transpose(1, 2).to(qq.dtype)
        vv = torch.cat([pv, tv], 1).transpose(1, 2).to(qq.dtype)
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=self._mask, scale=self.scale,
                                             enable_gqa=h != kvh)
        return out.transpose(1, 2).reshape(B * K, h, d)


class TreeDraftRunner:
    """The tree expansion over static buffers; ``capture()`` records it per padded batch."""

    def __init__(self, head: Eagle3DraftModel, embed: Callable[[torch.Tensor], torch.Tensor],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_tables: torch.Tensor, block_size: int,
                 h0: torch.Tensor, max_batch: int, topk: int, depth: int, device: torch.device,
                 graph_max_batch: int = 32, num_nodes: int | None = None) -> None:
        self.head = head
        self.embed = embed
        self.block_tables = block_tables  # [max_batch, max_blocks] long
        self.h0 = h0  # [max_batch, H]: the catch-up writes it
        self.max_batch = max_batch
        self.topk = topk
        self.depth = depth
        self.device = device
        self.attn = StaticTreeAttention(kv_caches, block_size, head.config.head_dim**-0.5, max_batch, topk, depth)
        self.base_pos = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.depths = candidate_depths(topk, depth)
        n = len(self.depths)
        self.cand_tok = torch.zeros(max_batch, n, dtype=torch.long, device=device)
        self.cand_score = torch.zeros(max_batch, n, dtype=torch.float32, device=device)
        self.cand_parent = torch.zeros(max_batch, n, dtype=torch.long, device=device)
        # every request's tree of num_nodes tokens, selected on the device (select_trees)
        self.num_nodes = num_nodes if num_nodes is not None else min(n, 63) + 1
        self.cand_depth = torch.tensor(self.depths, dtype=torch.long, device=device)
        self.sizes = torch.zeros(max_batch, dtype=torch.long, device=device)  # each request's drafts
        self.trees = torch.zeros(max_batch, tree_width(self.num_nodes), dtype=torch.long, device=device)
        T = max(depth - 1, 1) * topk
        # tree column block of each depth's nodes: a node sees itself there
        eye = torch.eye(topk, dtype=torch.bool, device=device)
        self._self_cols = [F.pad(eye, (i * topk, T - (i + 1) * topk)) for i in range(depth - 1)]
        self._first_parent = torch.full((topk,), -1, dtype=torch.long, device=device)
        self.batch_sizes = batch_buckets(min(max_batch, graph_max_batch))
        self.widths = width_buckets(block_tables.shape[1])
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.stats = GraphStats()

    def _body(self, B: int, W: int) -> None:
        """Expand rows [0, B) over the first W blocks of their tables and select each one's tree
        (reads only static buffers; writes the cand_* buffers and ``trees``)."""
        self._expand(B, W)
        select_trees(self.cand_tok[:B], self.cand_score[:B], self.cand_parent[:B], self.cand_depth, self.num_nodes,
                     self.depth, self.trees, self.sizes[:B])

    def _expand(self, B: int, W: int) -> None:
        head, K, D = self.head, self.topk, self.depth
        h = self.h0[:B]
        base = self.base_pos[:B]
        score, tok = torch.log_softmax(head.compute_logits(h), -1).topk(K, dim=-1)  # [B, K]
        tok = head.draft_to_target(tok)
        self.cand_tok[:B, :K].copy_(tok)
        self.cand_score[:B, :K].copy_(score)
        self.cand_parent[:B, :K].copy_(self._first_parent.expand(B, -1))
        if D < 2:
            return
        prefix_valid = self.attn.begin(self.block_tables[:B, :W], base)
        front_idx = torch.arange(K, device=self.device).expand(B, -1)  # candidate slot of each frontier node
        front_h = h[:, None, :].expand(B, K, h.shape[-1]).reshape(B * K, -1)
        front_tok, front_score = tok, score
        T = (D - 1) * K
        anc = torch.zeros(B, K, T, dtype=torch.bool, device=self.device)  # tree ancestors of each frontier node
        at = K
        for i in range(D - 1):  # depth i + 2
            sees = anc | self._self_cols[i]
            self.attn.set_depth(i, torch.cat([prefix_valid[:, None, :].expand(-1, K, -1), sees], 2))
            pos = (base + i).repeat_interleave(K)
            with forward_context(self.attn):
                h_out = head(self.embed(front_tok.reshape(-1)), front_h, pos)
            c_score, c_tok = torch.log_softmax(head.compute_logits(h_out), -1).topk(K, dim=-1)  # [B*K, K]
            c_score = (front_score.reshape(-1, 1) + c_score).reshape(B, K * K)
            c_tok = head.draft_to_target(c_tok).reshape(B, K * K)
            self.cand_tok[:B, at : at + K * K].copy_(c_tok)
            self.cand_score[:B, at : at + K * K].copy_(c_score)
            self.cand_parent[:B, at : at + K * K].copy_(front_idx.repeat_interleave(K, dim=1))
            front_score, best = c_score.topk(K, dim=-1)  # next frontier [B, K]
            parent = best // K  # which current node each new frontier node hangs under
            front_idx = at + best
            anc = sees.gather(1, parent[:, :, None].expand(-1, -1, T))
            front_h = h_out.view(B, K, -1).gather(1, parent[:, :, None].expand(-1, -1, h_out.shape[-1]))
            front_h = front_h.reshape(B * K, -1)
            front_tok = c_tok.gather(1, best)
            at += K * K

    def padded_batch(self, B: int) -> int | None:
        i = bisect.bisect_left(self.batch_sizes, B)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def width(self, base: list[int]) -> int:
        """Blocks that hold the longest committed prefix, rounded up to a captured width."""
        need = max(-(-max(base) // self.attn.block_size), 1)
        return self.widths[bisect.bisect_left(self.widths, need)]

    def load(self, base: list[int], tables: list[list[int]], Bp: int, sizes: list[int] | None = None) -> None:
        B = len(base)
        width = max(len(t) for t in tables)
        flat = base + [0] * (Bp - B) + (sizes or [self.num_nodes - 1] * B) + [0] * (Bp - B)
        for t in tables:
            flat.extend(t)
            flat.extend([0] * (width - len(t)))
        buf = host_to_device(flat, self.device)
        self.base_pos[:Bp].copy_(buf[:Bp])
        self.sizes[:Bp].copy_(buf[Bp : 2 * Bp])
        # columns past a row's own table keep stale block ids: their keys are masked by base_pos
        self.block_tables[:B, :width].copy_(buf[2 * Bp :].view(B, width))

    def run_device(self, base: list[int], tables: list[list[int]], sizes: list[int] | None = None) -> str:
        """Expand and select on the device, nothing read back: the trees (of ``sizes`` drafts; default
        num_nodes - 1) are in ``trees[:B]`` (h0[:B] must hold the catch-up output). Returns the path taken."""
        B = len(base)
        if B > self.max_batch:
            raise ValueError(f"tree batch {B} exceeds the expansion's {self.max_batch}")
        Bp, W = self.padded_batch(B), self.width(base)
        graph = self.graphs.get((Bp, W)) if Bp is not None else None
        if graph is not None:
            self.load(base, tables, Bp, sizes)
            graph.replay()
            return "graph"
        self.load(base, tables, B, sizes)
        self._body(B, W)
        return "eager"

    def run(self, base: list[int], tables: list[list[int]]) -> tuple[list[list[Candidate]], str]:
        """Every request's candidates (h0[:B] must hold the catch-up output) and the path taken."""
        B = len(base)
        path = self.run_device(base, tables)
        toks = self.cand_tok[:B].tolist()  # the expansion's one host sync
        scores = self.cand_score[:B].tolist()
        parents = self.cand_parent[:B].tolist()
        depths = self.depths
        cands = [[Candidate(t, s, p, d) for t, s, p, d in zip(toks[b], scores[b], parents[b], depths)]
                 for b in range(B)]
        return cands, path

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> GraphStats:
        """One CUDA graph per padded batch (up to ``graph_max_batch``) and block-table width."""
        self.base_pos.zero_()
        self.block_tables.zero_()
        keys = [(Bp, W) for Bp in reversed(self.batch_sizes) for W in reversed(self.widths)]
        self.graphs, self.stats = capture_each(keys, self._body, self.device, pool)
        return self.stats


class FusedTreeLaunch:
    """The tree's fused launch: from a verify's picks, each request's accepted path (accept_trees),
    the head's catch-up over it, the next expansion and the next trees (select_trees), all on the
    device and launched before the verify's host sync; one CUDA graph per (padded batch, width).

    A request verified the whole tree (root + num_nodes - 1 drafts, rows b * N + i). The catch-up
    runs L = min(depth, N - 1) + 1 rows per request at positions nc .. nc + L - 1: row j pairs the
    target feature of the accepted node at depth j with the token after it (the next accepted
    node's, or the bonus token at j = accepted); rows past that write draft KV at positions the next
    catch-up rewrites before anything reads them (the expansion reads keys below nc + 1 + accepted).
    It attends row by row (a decode attention, its metadata computed on the device). What the host
    writes (``write``, one copy): each row's position and KV slot, each request's nc and block
    table; padding rows write the scratch slot, padding requests accept nothing that matters."""

    def __init__(self, tree: TreeDraftRunner, row_attn: AttentionBackend, row_tables: torch.Tensor,
                 scratch_slot: int, feature_size: int, dtype: torch.dtype, max_batch: int) -> None:
        self.tree = tree
        self.device = tree.device
        self.N, self.D = tree.num_nodes, tree.depth
        self.L = min(self.D, self.N - 1) + 1
        self.batch_sizes = [b for b in tree.batch_sizes if b <= max_batch]
        Bm = self.batch_sizes[-1]
        self.width = tree.block_tables.shape[1]
        self.block_size = tree.attn.block_size
        self.scratch_slot = scratch_slot
        dev = self.device
        self.picks = torch.zeros(Bm * self.N, dtype=torch.long, device=dev)
        self.feats = torch.zeros(Bm * self.N, feature_size, dtype=dtype, device=dev)
        self.trees_in = torch.zeros(Bm, tree_width(self.N), dtype=torch.long, device=dev)
        self.meta = torch.zeros(self.layout(Bm)[-1], dtype=torch.long, device=dev)
        self.row_tables = row_tables  # [Bm * L, width]: each catch-up row's block table (its request's)
        self.row_attn = row_attn  # a decode attention over the draft KV reading row_tables
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.stats = GraphStats()

    def layout(self, Bp: int) -> list[int]:
        """Offsets in ``meta`` of pos, slot [Bp x L each], nc [Bp], block tables [Bp x width]."""
        n = Bp * self.L
        return np.cumsum([0, n, n, Bp, Bp * self.width]).tolist()

    def key(self, B: int, max_computed: int) -> tuple[int, int] | None:
        """(padded batch, expansion width) of a step of B requests, or None where not covered."""
        if B > self.batch_sizes[-1]:
            return None
        Bp = self.batch_sizes[bisect.bisect_left(self.batch_sizes, B)]
        return Bp, self.tree.width([max_computed + self.L])

    def _body(self, Bp: int, W: int) -> None:
        N, L, tree = self.N, self.L, self.tree
        head = tree.head
        o = self.layout(Bp)
        pos, slot, nc, tab = (self.meta[o[i] : o[i + 1]] for i in range(4))
        tok, par, dep, _ = tree_fields(self.trees_in[:Bp], N)
        accepted, path, bonus = accept_trees(tok, par, dep, self.picks[: Bp * N].view(Bp, N), self.D)
        j = torch.arange(L, device=self.device)[None, :]
        acc = accepted[:, None]
        node = torch.where(j <= acc, path[:, :L], path.gather(1, acc))  # [Bp, L]
        ids = torch.where(j < acc, tok.gather(1, path[:, 1 : L + 1]), bonus[:, None])
        rows = (torch.arange(Bp, device=self.device)[:, None] * N + node).reshape(-1)
        tree.block_tables[:Bp].copy_(tab.view(Bp, self.width))
        self.row_tables[: Bp * L].copy_(tree.block_tables[:Bp].repeat_interleave(L, dim=0))
        self.row_attn.set_step(slot, (pos + 1).to(torch.int32))
        with forward_context(self.row_attn):
            h = head(tree.embed(ids.reshape(-1)), head.combine(self.feats.index_select(0, rows)), pos)
        tree.h0[:Bp].copy_(h.view(Bp, L, -1).gather(1, acc[:, :, None].expand(-1, -1, h.shape[-1]))[:, 0])
        tree.base_pos[:Bp].copy_(nc + 1 + accepted)
        tree.sizes[:Bp].fill_(N - 1)
        tree._body(Bp, W)

    def write(self, key: tuple[int, int], computed: Sequence[int], tables: Sequence[Sequence[int]]) -> None:
        """A step's numbers into ``meta`` (one host-to-device copy): requests with ``computed``
        tokens in their KV before the verify, and their block tables."""
        Bp = key[0]
        L, bs = self.L, self.block_size
        o = self.layout(Bp)
        h, t = host_buffer(o[-1], torch.long, self.device)  # zeroed
        pos: list[int] = []
        slot: list[int] = []
        for nc, table in zip(computed, tables):
            for p in range(nc, nc + L):
                pos.append(p)
                slot.append(table[p // bs] * bs + p % bs)
        B = len(computed)
        h[o[0] : o[0] + len(pos)] = pos
        h[o[1] : o[2]] = slot + [self.scratch_slot] * (Bp * L - len(slot))
        h[o[2] : o[2] + B] = computed
        for b, table in enumerate(tables):
            start = o[3] + b * self.width
            h[start : start + len(table)] = table
        self.meta[: o[-1]].copy_(t, non_blocking=True)

    def run(self, key: tuple[int, int], picks: torch.Tensor, feats: torch.Tensor, trees: torch.Tensor,
            rows: torch.Tensor) -> str:
        """After ``write``: the verify's picks and target features (rows b * N + i) and the verified
        trees (rows ``rows`` of packed ``trees``) in, launch; the next trees are in ``tree.trees``."""
        T = picks.shape[0]
        self.picks[:T].copy_(picks)
        self.feats[:T].copy_(feats)
        self.trees_in[: rows.shape[0]].copy_(trees.index_select(0, rows))
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return "graph"
        self._body(*key)
        return "eager"

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> GraphStats:
        """A graph per (padded batch, width); warm-up and capture inputs: every row writes the scratch slot."""
        for t in (self.picks, self.feats, self.trees_in):
            t.zero_()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for key in [(Bp, W) for Bp in reversed(self.batch_sizes) for W in reversed(self.tree.widths)]:
            self.write(key, [], [])  # (outside the graph: it reads meta)
            self._body(*key)  # warm-up
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._body(*key)
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        self.stats = GraphStats(len(self.graphs), time.perf_counter() - t0,
                                max(0, free_before - torch.cuda.mem_get_info(self.device)[0]))
        return self.stats
