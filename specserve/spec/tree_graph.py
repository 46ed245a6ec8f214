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
from typing import Any, Callable

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionBackend, forward_context
from specserve.engine.host_copy import host_to_device
from specserve.models.eagle3 import Eagle3DraftModel
from specserve.spec.draft_graph import GraphStats, batch_buckets, capture_each
from specserve.spec.tree import Candidate


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
                 graph_max_batch: int = 32) -> None:
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
        """Expand rows [0, B) over the first W blocks of their tables (reads only static buffers;
        writes the cand_* buffers)."""
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

    def load(self, base: list[int], tables: list[list[int]], Bp: int) -> None:
        B = len(base)
        width = max(len(t) for t in tables)
        flat = base + [0] * (Bp - B)
        for t in tables:
            flat.extend(t)
            flat.extend([0] * (width - len(t)))
        buf = host_to_device(flat, self.device)
        self.base_pos[:Bp].copy_(buf[:Bp])
        # columns past a row's own table keep stale block ids: their keys are masked by base_pos
        self.block_tables[:B, :width].copy_(buf[Bp:].view(B, width))

    def run(self, base: list[int], tables: list[list[int]]) -> tuple[list[list[Candidate]], str]:
        """Every request's candidates (h0[:B] must hold the catch-up output) and the path taken."""
        B = len(base)
        if B > self.max_batch:
            raise ValueError(f"tree batch {B} exceeds the expansion's {self.max_batch}")
        Bp, W = self.padded_batch(B), self.width(base)
        graph = self.graphs.get((Bp, W)) if Bp is not None else None
        if graph is not None:
            self.load(base, tables, Bp)
            graph.replay()
            path = "graph"
        else:
            self.load(base, tables, B)
            self._body(B, W)
            path = "eager"
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
