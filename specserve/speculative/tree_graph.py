"""The EAGLE-2 tree expansion, the fused tree launch and the tree verify on static buffers, replayed as CUDA
graphs on the GPU (docs/architecture.md, "Trees": lanes, selection on the device)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from specserve.attention.base import AttentionBackend, forward_context
from specserve.attention.torch_decode import TorchDecodeAttention
from specserve.engine.cuda_graph import GraphStats, capture_each, dummy_meta, ladder, pad_to, replay_or_eager
from specserve.engine.host_copy import host_buffer
from specserve.engine.kv_cache import kv_slot
from specserve.engine.runner import kv_slab
from specserve.models.eagle3 import Eagle3DraftModel
from specserve.speculative.draft_graph import load_rows
from specserve.speculative.accept import accept_trees
from specserve.speculative.tree import select_trees, tree_fields, tree_width


def candidate_depths(topk: int, depth: int) -> list[int]:
    """Depth of each candidate slot: topk at depth 1, then topk^2 per depth up to ``depth``."""
    return [1] * topk + [d for d in range(2, depth + 1) for _ in range(topk * topk)]


def lane_blocks(block_size: int, depth: int) -> int:
    """Blocks of one frontier slot's lane: the request's partly filled last block and depth - 1 positions."""
    return (block_size - 1 + depth - 1) // block_size + 1


class TreeDraftRunner:
    """The tree expansion over static buffers; ``capture()`` records it per padded batch."""

    def __init__(self, head: Eagle3DraftModel, embed: Callable[[torch.Tensor], torch.Tensor],
                 attn: AttentionBackend, block_tables: torch.Tensor, block_size: int, first_lane_block: int,
                 h0: torch.Tensor, max_batch: int, topk: int, depth: int, device: torch.device, graph_max_batch: int = 32, num_nodes: int | None = None) -> None:
        self.head = head
        self.embed = embed
        self.attn = attn  # a decode attention over the draft KV reading its own block tables:
        self.row_tables = attn.block_tables  # [max_batch * topk, max_blocks], each frontier slot's
        self.block_tables = block_tables  # [max_batch, max_blocks] long
        self.block_size = block_size
        self.h0 = h0  # [max_batch, H]: the catch-up writes it
        self.max_batch = max_batch
        self.topk = topk
        self.depth = depth
        self.device = device
        nb = lane_blocks(block_size, depth)
        # lane blocks of frontier slot r: first_lane_block + r * nb + [0, nb)
        self.lanes = first_lane_block + torch.arange(max_batch * topk * nb, device=device).view(-1, nb)
        self.kv_blocks = kv_slab(attn.kv_caches).unflatten(1, (-1, block_size))  # [2 x layers, blocks, bs, kvh, d]
        self.base_pos = torch.zeros(max_batch, dtype=torch.long, device=device)
        depths = candidate_depths(topk, depth)
        # every request's tree of num_nodes tokens, selected on the device (select_trees)
        self.num_nodes = num_nodes if num_nodes is not None else min(len(depths), 63) + 1
        self.cand_depth = torch.tensor(depths, dtype=torch.long, device=device)
        self.sizes = torch.zeros(max_batch, dtype=torch.long, device=device)  # each request's drafts
        self.trees = torch.zeros(max_batch, tree_width(self.num_nodes), dtype=torch.long, device=device)
        self._first_parent = torch.full((topk,), -1, dtype=torch.long, device=device)
        self._steps = torch.arange(max(depth - 1, 1), device=device)
        self.batch_sizes = ladder(min(max_batch, graph_max_batch))
        self.graphs: dict[tuple[int, ...], torch.cuda.CUDAGraph] = {}
        self.stats = GraphStats()

    def _body(self, B: int, max_kv: list[int] | None = None) -> None:
        """Expand rows [0, B) from h0 and select each one's tree (reads only static buffers; writes ``trees``):
        every depth's candidates [B, C] (tokens, scores, parents), one concatenation each at the end (at one
        request the expansion is bound by its kernel count). ``max_kv``: keys each depth reads (eager only)."""
        h = self.h0[:B]
        score, tok = self.head.top_drafts(h, self.topk)  # [B, K]
        toks, scores, parents = [tok], [score], [self._first_parent.expand(B, -1)]
        if self.depth >= 2:
            self._expand(B, h, tok, score, toks, scores, parents, max_kv)
        select_trees(torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1), self.cand_depth, self.num_nodes,
                     self.depth, self.trees, self.sizes[:B])

    def _expand(self, B: int, h: torch.Tensor, tok: torch.Tensor, score: torch.Tensor, toks: list[torch.Tensor],
                scores: list[torch.Tensor], parents: list[torch.Tensor], max_kv: list[int] | None) -> None:
        head, K, D, bs = self.head, self.topk, self.depth, self.block_size
        R = B * K
        lanes = self.lanes[:R]
        nb = lanes.shape[1]
        bt = self.block_tables[:B]
        base = self.base_pos[:B].repeat_interleave(K)  # [R]
        first = base // bs  # the block that holds position base
        # each slot's table: its request's, the lane's blocks from column `first` on
        rel = torch.arange(bt.shape[1], device=self.device)[None, :] - first[:, None]
        own = bt.repeat_interleave(K, dim=0)
        self.row_tables[:R].copy_(torch.where((rel >= 0) & (rel < nb), lanes.gather(1, rel.clamp(0, nb - 1)), own))
        # the committed part of block `first` into every lane (the rest of it is rewritten or unread)
        src = own.gather(1, first.clamp(max=bt.shape[1] - 1)[:, None])[:, 0]
        kvb = self.kv_blocks
        kvb.index_copy_(1, lanes[:, 0], kvb.index_select(1, src))
        # every depth's position, lane slot and key count ([D - 1, R])
        pos = base[None, :] + self._steps[:, None]
        lane_pos = (pos - first[None, :] * bs).t()  # [R, D - 1]: positions within each slot's lane
        slots = kv_slot(lanes, lane_pos, bs, torch.arange(R, device=self.device)[:, None]).t().contiguous()
        seqs = (pos + 1).to(torch.int32)
        front_idx = torch.arange(K, device=self.device).expand(B, -1)  # candidate slot of each frontier node
        front_h = h[:, None, :].expand(B, K, h.shape[-1]).reshape(R, -1)
        front_tok, front_score = tok, score
        rows = torch.arange(B, device=self.device)[:, None] * K
        at = K
        for i in range(D - 1):  # depth i + 2
            self.attn.set_step(slots[i], seqs[i], None if max_kv is None else max_kv[i])
            with forward_context(self.attn):
                h_out = head(self.embed(front_tok.reshape(-1)), front_h, pos[i])
            c_score, c_tok = head.top_drafts(h_out, K)  # [R, K]
            c_score = (front_score.reshape(-1, 1) + c_score).reshape(B, K * K)
            c_tok = c_tok.reshape(B, K * K)
            toks.append(c_tok)
            scores.append(c_score)
            parents.append(front_idx.repeat_interleave(K, dim=1))
            if i == D - 2:
                break
            front_score, best = c_score.topk(K, dim=-1)  # next frontier [B, K]
            parent = (rows + best // K).reshape(-1)  # the frontier slot each new node hangs under
            front_idx = at + best
            front_h = h_out.index_select(0, parent)
            front_tok = c_tok.gather(1, best)
            # each new slot's lane: its parent's path
            kvb.index_copy_(1, lanes.reshape(-1), kvb.index_select(1, lanes.index_select(0, parent).reshape(-1)))
            at += K * K

    def load(self, base: list[int], tables: list[list[int]], Bp: int, sizes: list[int] | None = None) -> None:
        sizes = sizes or [self.num_nodes - 1] * len(base)
        load_rows(self.device, Bp, [(self.base_pos, base), (self.sizes, sizes)], self.block_tables, tables)

    def run_device(self, base: list[int], tables: list[list[int]], sizes: list[int] | None = None) -> str:
        """Expand and select on the device, nothing read back: the trees (of ``sizes`` drafts; default
        num_nodes - 1) are in ``trees[:B]`` (h0[:B] must hold the catch-up output). Returns the path taken."""
        B = len(base)
        if B > self.max_batch:
            raise ValueError(f"tree batch {B} exceeds the expansion's {self.max_batch}")
        Bp = pad_to(self.batch_sizes, B)
        graph = self.graphs.get((Bp,)) if Bp is not None else None
        if graph is not None:
            self.load(base, tables, Bp, sizes)
            graph.replay()
            return "graph"
        self.load(base, tables, B, sizes)
        max_kv = None  # (the torch attention gathers only the keys in use, else a whole block-table row)
        if isinstance(self.attn, TorchDecodeAttention):
            max_kv = [max(base) + i + 1 for i in range(self.depth - 1)]
        self._body(B, max_kv)
        return "eager"

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> GraphStats:
        """One CUDA graph per padded batch (up to ``graph_max_batch``)."""
        self.base_pos.zero_()
        self.block_tables.zero_()
        keys = [(Bp,) for Bp in reversed(self.batch_sizes)]
        self.graphs, self.stats = capture_each(keys, self._body, self.device, pool)
        return self.stats


class FusedTreeLaunch:
    """From a verify's picks: acceptance, target KV compaction, catch-up over the accepted path, the next
    expansion and the inputs of the next trees' verify, on the device before the sync; a graph per batch.
    ``compact``: ModelRunner.compact_tree_kv; ``window``: the target has a window pool (its tables too)."""

    def __init__(self, tree: TreeDraftRunner, row_attn: AttentionBackend, scratch_slot: int, feature_size: int,
                 dtype: torch.dtype, max_batch: int, compact: Callable[..., None], features: torch.Tensor,
                 window: bool = False) -> None:
        self.tree = tree
        self.device = tree.device
        self.N, self.D = tree.num_nodes, tree.depth
        self.L = min(self.D, self.N - 1) + 1
        self.batch_sizes = [b for b in tree.batch_sizes if b <= max_batch]
        Bm = self.batch_sizes[-1]
        self.width = tree.block_tables.shape[1]
        self.block_size = tree.block_size
        self.scratch_slot = scratch_slot
        self.window = window
        dev = self.device
        self.picks = torch.zeros(Bm * self.N, dtype=torch.long, device=dev)
        self.feats = torch.zeros(Bm * self.N, feature_size, dtype=dtype, device=dev)
        self.trees_in = torch.zeros(Bm, tree_width(self.N), dtype=torch.long, device=dev)
        self.layouts = {Bp: self.layout(Bp) for Bp in self.batch_sizes}  # (on the host's path of every cycle)
        self.meta = torch.zeros(self.layouts[Bm][-1], dtype=torch.long, device=dev)
        self.row_attn = row_attn  # a decode attention over the draft KV reading its own block tables:
        self.row_tables = row_attn.block_tables  # [Bm * L, width], each catch-up row's (its request's)
        self.compact = compact
        self.features = features  # the drafter's target features by KV slot: the accepted rows' are kept
        self.next_ids = torch.zeros(Bm, self.N, dtype=torch.long, device=dev)
        self.next_pos = torch.zeros(Bm, self.N, dtype=torch.long, device=dev)
        self.next_slots = torch.zeros(Bm, self.N, dtype=torch.long, device=dev)
        self.next_window_slots = torch.zeros(Bm, self.N, dtype=torch.long, device=dev) if window else None
        self.next_shift = torch.zeros(Bm, dtype=torch.int32, device=dev)  # (the attention's limits are int32)
        self.graphs: dict[tuple[int], torch.cuda.CUDAGraph] = {}
        self.stats = GraphStats()

    def layout(self, Bp: int) -> list[int]:
        """Offsets in ``meta``: pos, slot [Bp x L each], nc [Bp], block tables [Bp x width], live [Bp]
        (1: a request), the verified trees' rows in their packed tensor [Bp] (read by ``run``), and the
        window pool's block tables [Bp x width] (none without one)."""
        n = Bp * self.L
        return np.cumsum([0, n, n, Bp, Bp * self.width, Bp, Bp, Bp * self.width * self.window]).tolist()

    def key(self, B: int) -> tuple[int] | None:
        """(padded batch,) of a step of B requests, or None where not covered."""
        Bp = pad_to(self.batch_sizes, B)
        return None if Bp is None else (Bp,)

    def _body(self, Bp: int) -> None:
        N, L, tree = self.N, self.L, self.tree
        head = tree.head
        o = self.layouts[Bp]
        pos, slot, nc, tab, live = (self.meta[o[i] : o[i + 1]] for i in range(5))  # (and the rows: run)
        tab = tab.view(Bp, self.width)
        wtab = self.meta[o[6] : o[7]].view(Bp, self.width) if self.window else None
        tok, par, dep, _ = tree_fields(self.trees_in[:Bp], N)
        accepted, path, bonus = accept_trees(tok, par, dep, self.picks[: Bp * N].view(Bp, N), self.D)
        self.compact(tab, nc, accepted, path[:, :L], live, wtab)
        j = torch.arange(L, device=self.device)[None, :]
        acc = accepted[:, None]
        node = torch.where(j <= acc, path[:, :L], path.gather(1, acc))  # [Bp, L]
        ids = torch.where(j < acc, tok.gather(1, path[:, 1 : L + 1]), bonus[:, None])
        rows = (torch.arange(Bp, device=self.device)[:, None] * N + node).reshape(-1)
        tree.block_tables[:Bp].copy_(tab)
        self.row_tables[: Bp * L].copy_(tree.block_tables[:Bp].repeat_interleave(L, dim=0))
        f = self.feats.index_select(0, rows)
        # row j's feature at position nc + j where j <= accepted (the rest: the scratch slot; padding
        # rows' slots are scratch already)
        kept = torch.where(j <= acc, slot.view(Bp, L), torch.full_like(slot.view(Bp, L), self.scratch_slot))
        self.features.index_copy_(0, kept.reshape(-1), f)
        self.row_attn.set_step(slot, (pos + 1).to(torch.int32))
        with forward_context(self.row_attn):
            h = head(tree.embed(ids.reshape(-1)), head.combine(f), pos)
        tree.h0[:Bp].copy_(h.view(Bp, L, -1).gather(1, acc[:, :, None].expand(-1, -1, h.shape[-1]))[:, 0])
        tree.base_pos[:Bp].copy_(nc + 1 + accepted)
        tree.sizes[:Bp].fill_(N - 1)
        tree._body(Bp)
        ntok, _, ndep, _ = tree_fields(tree.trees[:Bp], N)
        start = tree.base_pos[:Bp, None]  # the bonus token's position: the next tree's root
        self.next_ids[:Bp, :1].copy_(bonus[:, None])
        self.next_ids[:Bp, 1:].copy_(ntok[:, 1:])
        torch.add(ndep, start, out=self.next_pos[:Bp])
        rows = torch.arange(Bp, device=self.device)[:, None]
        nodes = start + torch.arange(N, device=self.device)[None, :]
        self.next_slots[:Bp].copy_(kv_slot(tab, nodes, self.block_size, rows, self.width - 1))
        if wtab is not None:
            self.next_window_slots[:Bp].copy_(kv_slot(wtab, nodes, self.block_size, rows, self.width - 1))
        torch.sub(accepted, L - 1, out=self.next_shift[:Bp])

    def write(self, key: tuple[int], computed: Sequence[int], tables: Sequence[Sequence[int]],
              rows: Sequence[int] = (), window_tables: Sequence[Sequence[int]] = ()) -> None:
        """A step's numbers into ``meta`` (one copy): each request's tokens computed before the verify, its
        block tables and its tree's row in the packed tensor ``run`` is given."""
        Bp = key[0]
        L, bs = self.L, self.block_size
        o = self.layouts[Bp]
        h, t = host_buffer(o[-1], torch.long, self.device)  # zeroed
        pos: list[int] = []
        slot: list[int] = []
        for nc, table in zip(computed, tables):
            for p in range(nc, nc + L):
                pos.append(p)
                slot.append(kv_slot(table, p, bs))
        B = len(computed)
        h[o[0] : o[0] + len(pos)] = pos
        h[o[1] : o[2]] = slot + [self.scratch_slot] * (Bp * L - len(slot))
        h[o[2] : o[2] + B] = computed
        for b, table in enumerate(tables):
            start = o[3] + b * self.width
            h[start : start + len(table)] = table
        h[o[4] : o[4] + B] = 1
        h[o[5] : o[5] + len(rows)] = rows
        for b, table in enumerate(window_tables):
            start = o[6] + b * self.width
            h[start : start + len(table)] = table
        self.meta[: o[-1]].copy_(t, non_blocking=True)

    def run(self, key: tuple[int], picks: torch.Tensor, feats: torch.Tensor, trees: torch.Tensor) -> str:
        """After ``write``: the verify's picks and features (rows b * N + i) and the verified trees in,
        launch; the next trees are in ``tree.trees``."""
        T = picks.shape[0]
        Bp = key[0]
        o = self.layouts[Bp]
        self.picks[:T].copy_(picks)
        self.feats[:T].copy_(feats)
        # (padding requests take row 0's tree: they accept nothing that is read)
        self.trees_in[:Bp].copy_(trees.index_select(0, self.meta[o[5] : o[6]]))
        return replay_or_eager(self.graphs, key, self._body)

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> GraphStats:
        """A graph per padded batch; warm-up and capture inputs: every row writes the scratch slot."""
        for t in (self.picks, self.feats, self.trees_in):
            t.zero_()
        keys = [(Bp,) for Bp in reversed(self.batch_sizes)]
        self.graphs, self.stats = capture_each(keys, self._body, self.device, pool,  # type: ignore[assignment]
                                               prepare=lambda *key: self.write(key, [], []))  # type: ignore[arg-type]
        return self.stats


class TreeVerifyGraph:
    """The target's verify of the trees a FusedTreeLaunch selected, from its ``next_ids``/``next_pos``;
    picks and features land in the launch's buffers, which its next run reads (nothing copied)."""

    def __init__(self, launch: FusedTreeLaunch, model: Any, attn: AttentionBackend, vocab_size: int) -> None:
        self.launch = launch
        self.model = model  # the target (its forward returns (hidden, aux features) for EAGLE-3)
        self.attn = attn  # the target's attention backend
        rows = launch.batch_sizes[-1] * launch.N
        self.logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=launch.device)
        self.graphs: dict[tuple[int], torch.cuda.CUDAGraph] = {}
        self.stats = GraphStats()

    def _body(self, Bp: int) -> None:
        tl = self.launch
        T = Bp * tl.N
        with forward_context(self.attn):
            out = self.model(tl.next_ids[:Bp].view(-1), tl.next_pos[:Bp].view(-1))
        hidden, feats = out if isinstance(out, tuple) else (out, out)
        logits = self.model.compute_logits(hidden)
        self.logits[:T].copy_(logits)
        torch.argmax(logits, dim=-1, out=tl.picks[:T])
        tl.feats[:T].copy_(feats)

    def run(self, B: int) -> str:
        """The verify of the first B requests' trees (the attention planned for them); the path taken."""
        key = self.launch.key(B)
        assert key is not None
        graph = self.graphs.get(key)
        if graph is None:  # (eagerly over its own tokens: the attention was planned for those)
            self._body(B)
            return "eager"
        graph.replay()
        return "graph"

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> GraphStats:
        """A graph per padded batch of the launch, its attention launches sized for any step of one
        request's tree up to the batch's (graph_min_tokens), planned over the scratch block."""
        tl, attn = self.launch, self.attn

        def prepare(Bp: int) -> None:
            attn.graph_min_tokens = tl.N
            attn.plan(dummy_meta(attn, Bp * tl.N, tl.device))

        keys = [(Bp,) for Bp in reversed(tl.batch_sizes)]
        attn.capture_exact = getattr(attn, "exact_trees", False)  # its steps are trees: the EXACT kernel
        try:
            self.graphs, self.stats = capture_each(keys, self._body, tl.device, pool, prepare=prepare)  # type: ignore[assignment]
        finally:
            attn.graph_min_tokens = 1
            attn.capture_exact = False
        return self.stats
