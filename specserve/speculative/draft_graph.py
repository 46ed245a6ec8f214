"""The greedy chain draft loop, the catch-up and the fused launch on static buffers, replayed as CUDA
graphs on the GPU and run eagerly elsewhere (docs/architecture.md, "Draft loop on static buffers")."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np
import torch

from specserve.attention.base import AttentionBackend, AttentionMetadata, forward_context
from specserve.attention.torch_decode import TorchDecodeAttention
from specserve.engine.cuda_graph import (GraphStats, capture_each, capture_per_size, fit_sizes, ladder, pad_to,
                                         replay_or_eager)
from specserve.engine.host_copy import host_buffer, host_to_device
from specserve.engine.kv_cache import kv_slot
from specserve.models.eagle3 import Eagle3DraftModel
from specserve.speculative.accept import accept_chains_on_device

log = logging.getLogger(__name__)

def load_rows(device: torch.device, Bp: int, columns: list[tuple[torch.Tensor, list[int]]], block_tables: torch.Tensor,
              tables: list[list[int]]) -> None:
    """Per-request numbers (each column padded with 0 to Bp rows) and block tables into static buffers, one copy;
    table columns past a row's own keep stale block ids (no key there is read)."""
    B, width = len(tables), max(len(t) for t in tables)
    flat = [v for _, vals in columns for v in vals + [0] * (Bp - len(vals))]
    for t in tables:
        flat += t + [0] * (width - len(t))
    buf = host_to_device(flat, device)
    for i, (dst, _) in enumerate(columns):
        dst[:Bp].copy_(buf[i * Bp : (i + 1) * Bp])
    block_tables[:B, :width].copy_(buf[len(columns) * Bp :].view(B, width))


class ChainDraftRunner:
    """The greedy chain draft loop over static buffers; ``capture()`` records it per (padded batch, K)."""

    def __init__(self, head: Eagle3DraftModel, embed: Callable[[torch.Tensor], torch.Tensor],
                 attn: AttentionBackend, block_tables: torch.Tensor, block_size: int, scratch_slot: int,
                 max_batch: int, max_k: int, device: torch.device, dtype: torch.dtype) -> None:
        self.head = head
        self.embed = embed
        self.attn = attn  # TorchDecodeAttention or TritonDecodeAttention over the draft KV
        self.block_tables = block_tables  # [max_batch, max_blocks] long, shared with attn
        self.block_size = block_size
        self.scratch_slot = scratch_slot
        self.max_batch = max_batch
        self.max_k = max_k
        self.device = device
        H = head.config.hidden_size
        self.h0 = torch.zeros(max_batch, H, dtype=dtype, device=device)
        self.base_pos = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.ks = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.tokens = torch.zeros(max_batch, max_k, dtype=torch.long, device=device)
        self.step_index = torch.arange(max(max_k - 1, 1), dtype=torch.long, device=device)
        self.batch_sizes = ladder(max_batch)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.stats = GraphStats()
        self.pad_batches = device.type == "cuda"

    def _body(self, B: int, K: int, max_kv: list[int] | None = None) -> None:
        """Draft K tokens for rows [0, B) from h0, base_pos, ks, block_tables into ``tokens``; rows past
        their k write the scratch slot and attend one key, so one graph serves any mix of k."""
        head, bs = self.head, self.block_size
        h = self.h0[:B]
        tok = head.greedy_draft(h)
        self.tokens[:B, 0].copy_(tok)
        if K == 1:
            return
        # every later step's position, KV slot and key count at once, a row per step ([K - 1, B]): at
        # one request the loop is bound by its kernel count, and per step these took ~14 small kernels
        base, ks, bt = self.base_pos[:B], self.ks[:B], self.block_tables[:B]
        step = self.step_index[: K - 1, None]  # draft j = step + 2
        pos = base[None, :] + step
        active = ks[None, :] >= step + 2
        rows = torch.arange(B, device=pos.device)[None, :]
        slots = torch.where(active, kv_slot(bt, pos, bs, rows, bt.shape[1] - 1), self.scratch_slot)
        seqs = torch.where(active, pos + 1, 1).to(torch.int32)  # a finished row reads one key
        for j in range(2, K + 1):
            self.attn.set_step(slots[j - 2], seqs[j - 2], None if max_kv is None else max_kv[j - 2])
            with forward_context(self.attn):
                h = head(self.embed(tok), h, pos[j - 2])
            tok = head.greedy_draft(h)
            self.tokens[:B, j - 1].copy_(tok)

    def load(self, base: list[int], ks: list[int], tables: list[list[int]], Bp: int,
             device_base: torch.Tensor | None = None) -> None:
        """Write the step's per-request numbers into the static buffers (padding rows: k = 0)."""
        load_rows(self.device, Bp, [(self.base_pos, base), (self.ks, ks)], self.block_tables, tables)
        if device_base is not None:
            self.base_pos[: len(ks)].copy_(device_base)

    def run(self, base: list[int], ks: list[int], tables: list[list[int]],
            device_base: torch.Tensor | None = None) -> tuple[torch.Tensor, str]:
        """Drafts [B, max(ks)] on the device (h0[:B] holds the catch-up's output) and the path taken;
        ``device_base``: base positions computed on the device (``base`` then bounds them)."""
        B, K = len(ks), max(ks)
        if B > self.max_batch or K > self.max_k:
            raise ValueError(f"draft batch {B} x {K} exceeds the loop's {self.max_batch} x {self.max_k}")
        Bp = pad_to(self.batch_sizes, B)  # (B <= max_batch, the last size)
        graph = self.graphs.get((Bp, K))
        # padded to the graph's shapes exactly on the GPU (there eager and graph drafts are bitwise equal)
        Bp = Bp if graph is not None or self.pad_batches else B
        self.load(base, ks, tables, Bp, device_base)
        if graph is not None:
            graph.replay()
            return self.tokens[:B, :K], "graph"
        max_kv = None
        if isinstance(self.attn, TorchDecodeAttention) and not self.pad_batches:  # only the keys in use
            max_kv = [max(b + j - 1 for b, k in zip(base, ks) if k >= j) for j in range(2, K + 1)]
        self._body(Bp, K, max_kv)
        return self.tokens[:B, :K], "eager"

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> GraphStats:
        """One CUDA graph per (padded batch, K <= max_k): switching k never re-captures."""
        # capture-time inputs: every row inactive, so only the scratch slot is written
        self.base_pos.zero_()
        self.ks.zero_()
        self.block_tables.zero_()
        self.h0.zero_()
        keys = [(Bp, K) for Bp in reversed(self.batch_sizes) for K in range(self.max_k, 0, -1)]
        self.graphs, self.stats = capture_each(keys, self._body, self.device, pool)
        return self.stats


class CatchUpRunner:
    """The head over a ragged batch of committed positions (CUDA, Triton attention), writing each
    request's last output row into ``h_out``; CUDA graphs per padded token count."""

    def __init__(self, head: Eagle3DraftModel, embed: Callable[[torch.Tensor], torch.Tensor], attn: Any,
                 h_out: torch.Tensor, sizes: list[int], device: torch.device, dtype: torch.dtype) -> None:
        self.head = head
        self.embed = embed
        self.attn = attn  # a TritonBackend over the draft KV
        self.h_out = h_out  # [max_batch, H]
        self.sizes = fit_sizes(attn, sizes) if sizes else []
        self.device = device
        n = self.sizes[-1] if self.sizes else 0
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.pos = torch.zeros(n, dtype=torch.long, device=device)
        self.feats = torch.zeros(n, head.config.feature_size, dtype=dtype, device=device)
        self.last = torch.zeros(h_out.shape[0], dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.stats = GraphStats()

    @property
    def max_tokens(self) -> int:
        return self.attn.max_num_tokens

    def _forward(self, ids: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        with forward_context(self.attn):
            return self.head(self.embed(ids), self.head.combine(feats), pos)

    def _graph_body(self, n: int) -> None:
        h = self._forward(self.ids[:n], self.feats[:n], self.pos[:n])
        self.h_out.copy_(h.index_select(0, self.last))

    def _plan(self, ids: Sequence[int], pos: Sequence[int], slots: Sequence[int], q_lens: list[int],
              seq_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """The step's numbers on the device (ids | positions | slots | each request's last row, padded
        to h_out's rows | block tables), the attention planned over them."""
        T, B = len(ids), len(q_lens)
        width = max(len(t) for t in tables)
        n_last = self.last.shape[0]
        last = np.zeros(n_last, dtype=np.int64)
        last[:B] = np.cumsum(q_lens) - 1
        tab = np.zeros((B, width), dtype=np.int64)
        for i, t in enumerate(tables):
            tab[i, : len(t)] = t
        flat = np.concatenate([np.asarray(ids, dtype=np.int64), np.asarray(pos, dtype=np.int64),
                               np.asarray(slots, dtype=np.int64), last, tab.reshape(-1)])
        buf = host_to_device(flat, self.device)
        o = 3 * T + n_last
        self.attn.plan(AttentionMetadata(query_lens=q_lens, seq_lens=seq_lens, slot_mapping=buf[2 * T : 3 * T],
                                         block_tables=buf[o:].view(B, width)))
        return buf

    def run(self, ids: Sequence[int], pos: Sequence[int], slots: Sequence[int], q_lens: list[int],
            seq_lens: list[int], tables: list[list[int]], feats: torch.Tensor,
            device_ids: torch.Tensor | None = None, device_last: torch.Tensor | None = None) -> str:
        """Fills h_out[:B]; the path taken. ``device_ids`` / ``device_last``: token ids / each request's
        output row computed on the device, in place of ``ids`` and the last row of each ``q_lens``."""
        T, B = len(ids), len(q_lens)
        buf = self._plan(ids, pos, slots, q_lens, seq_lens, tables)
        o = 3 * T + self.last.shape[0]
        if self.sizes and T <= self.sizes[-1]:  # static buffers padded to a captured size
            n = pad_to(self.sizes, T)
            self.ids[:T].copy_(buf[:T] if device_ids is None else device_ids)
            self.pos[:T].copy_(buf[T : 2 * T])
            self.feats[:T].copy_(feats)
            self.last.copy_(buf[3 * T : o])
            if device_last is not None:
                self.last[:B].copy_(device_last)
            graph = self.graphs.get(n)
            if graph is not None:
                graph.replay()
                return "graph"
            self._graph_body(n)  # the graph's computation, eagerly (tests compare the two)
            return "eager"
        h = self._forward(buf[:T] if device_ids is None else device_ids, feats, buf[T : 2 * T])
        self.h_out[:B].copy_(h.index_select(0, buf[3 * T : 3 * T + B] if device_last is None else device_last))
        return "eager"

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> GraphStats:
        self.last.zero_()
        secs, nbytes = capture_per_size(self.attn, self.sizes, self._graph_body, self.device, self.graphs, {}, pool)
        self.stats = GraphStats(len(self.graphs), secs, nbytes)
        return self.stats


FUSED_MAX_BATCH = 4  # requests per step the fused launch graphs cover (where a cycle is host-bound: ~125 graphs at k <= 5)


class FusedLaunchRunner:
    """Acceptance, catch-up over every verified row and the next chain (pipeline.launch_fused) as one CUDA
    graph per (catch-up size, padded batch, k verified, k next); its inputs one copy of ``meta``."""

    def __init__(self, cu: CatchUpRunner, chain: ChainDraftRunner, device: torch.device) -> None:
        from specserve.attention.triton_decode import TritonDecodeAttention

        self.chain = chain
        self.device = device
        self.batch_sizes = [b for b in chain.batch_sizes if b <= FUSED_MAX_BATCH]
        Bm, K = self.batch_sizes[-1], chain.max_k
        if not cu.sizes:
            raise ValueError("the fused launch needs the catch-up's graph sizes")
        if not isinstance(chain.attn, TritonDecodeAttention):
            raise ValueError("the fused launch needs the draft loop's Triton decode attention")
        need = Bm * (K + 1)  # the most rows a covered step verifies
        cut = pad_to(cu.sizes, need) or cu.sizes[-1]
        self.sizes = [s for s in cu.sizes if s <= cut]
        self.max_tokens = min(need, self.sizes[-1])
        n = self.sizes[-1]
        self.width = chain.block_tables.shape[1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.picks = torch.zeros(n, dtype=torch.long, device=device)
        self.feats = torch.zeros(n, cu.feats.shape[1], dtype=cu.feats.dtype, device=device)
        self.meta = torch.zeros(self.layout(n, Bm, K)[-1], dtype=torch.long, device=device)
        # each catch-up row's block table (its request's), for the row-by-row attention
        self.row_tables = torch.zeros(n, self.width, dtype=torch.long, device=device)
        a = chain.attn
        self.row_attn = TritonDecodeAttention(a.kv_caches, a.block_size, a.scale, num_heads=a.num_heads,
                                              block_tables=self.row_tables)
        self.graphs: dict[tuple[int, int, int, int], torch.cuda.CUDAGraph] = {}
        self.stats = GraphStats()

    def key(self, T: int, B: int, k_verified: int, k_next: int) -> tuple[int, int, int, int] | None:
        """(catch-up size, padded batch, drafts verified, drafts to make) of a step, or None where
        these graphs do not cover it."""
        if B > self.batch_sizes[-1] or T > self.max_tokens or k_verified > self.chain.max_k or k_next > self.chain.max_k:
            return None
        return pad_to(self.sizes, T), pad_to(self.batch_sizes, B), k_verified, k_next  # type: ignore[return-value]

    def layout(self, n: int, Bp: int, K: int) -> list[int]:
        """Offsets in ``meta`` of nxt, j, req, pos, slot [n each], draft rows, exists [Bp x K each],
        first, base, ks [Bp each], block tables [Bp x width]."""
        return np.cumsum([0, n, n, n, n, n, Bp * K, Bp * K, Bp, Bp, Bp, Bp * self.width]).tolist()

    def _body(self, n: int, Bp: int, K: int, Kc: int) -> None:
        o = self.layout(n, Bp, K)
        nxt, j, req, pos, slot, drow, exists, first, base, ks, tab = (self.meta[o[i] : o[i + 1]] for i in range(11))
        accepted, ids = accept_chains_on_device(self.ids[:n], self.picks[:n], nxt, j, req, drow, exists, first)
        chain, head = self.chain, self.chain.head
        chain.block_tables[:Bp].copy_(tab.view(Bp, self.width))
        chain.ks[:Bp].copy_(ks)
        self.row_tables[:n].copy_(chain.block_tables.index_select(0, req))
        self.row_attn.set_step(slot, (pos + 1).to(torch.int32))
        with forward_context(self.row_attn):
            h = head(chain.embed(ids), head.combine(self.feats[:n]), pos)
        chain.h0[:Bp].copy_(h.index_select(0, first + accepted))
        chain.base_pos[:Bp].copy_(base + accepted)
        chain._body(Bp, Kc)

    def write(self, key: tuple[int, int, int, int], computed: Sequence[int], ks: Sequence[int],
              next_ks: Sequence[int], tables: Sequence[Sequence[int]]) -> None:
        """A step's numbers into ``meta`` (one host-to-device copy), in plain Python: at most
        FUSED_MAX_BATCH x (max_k + 1) rows, where each numpy call would cost more than the loop."""
        n, Bp, K, _ = key
        bs, scratch = self.chain.block_size, self.chain.scratch_slot
        nxt: list[int] = []
        js: list[int] = []
        req: list[int] = []
        pos: list[int] = []
        slot: list[int] = []
        first: list[int] = []
        T = 0
        for b, (nc, k, table) in enumerate(zip(computed, ks, tables)):
            first.append(T)
            for j in range(k + 1):  # row j at position nc + j; the draft after it is in row j + 1 (<= k)
                p = nc + j
                nxt.append(T + min(j + 1, k))
                js.append(j)
                req.append(b)
                pos.append(p)
                slot.append(kv_slot(table, p, bs))
            T += k + 1
        o = self.layout(n, Bp, K)
        h, t = host_buffer(o[-1], torch.long, self.device)  # zeroed
        # padding rows: the next row their own, j = n (never before an accepted count), request 0,
        # position 0, the scratch slot; padding requests: no drafts, nothing to draft
        h[o[0] : o[1]] = nxt + list(range(T, n))
        h[o[1] : o[2]] = js + [n] * (n - T)
        h[o[2] : o[2] + T] = req
        h[o[3] : o[3] + T] = pos
        h[o[4] : o[5]] = slot + [scratch] * (n - T)
        for b, k in enumerate(ks):  # each request's draft rows (first + i, for i < k) and which exist
            h[o[5] + b * K : o[5] + b * K + k] = range(first[b], first[b] + k)
            h[o[6] + b * K : o[6] + b * K + k] = 1
        B = len(ks)
        h[o[7] : o[7] + B] = first
        h[o[8] : o[8] + B] = [nc + 1 for nc in computed]  # the chain's base before acceptance
        h[o[9] : o[9] + B] = next_ks
        for b, table in enumerate(tables):
            start = o[10] + b * self.width
            h[start : start + len(table)] = table
        self.meta[: o[-1]].copy_(t, non_blocking=True)

    def run(self, key: tuple[int, int, int, int], ids: torch.Tensor, picks: torch.Tensor, feats: torch.Tensor) -> str:
        """After ``write``: the verify's input ids, picks and target features in, launch; returns
        "graph" or "eager"."""
        T = ids.shape[0]
        self.ids[:T].copy_(ids)
        self.picks[:T].copy_(picks)
        self.feats[:T].copy_(feats)
        return replay_or_eager(self.graphs, key, self._body)

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> GraphStats:
        """A graph for every key a step of up to FUSED_MAX_BATCH requests can have; the inputs of each
        warm-up and capture: no row accepts, every row writes the scratch slot, nothing is drafted."""
        K = self.chain.max_k
        keys = set()
        for B in range(1, self.batch_sizes[-1] + 1):
            for kv in range(1, K + 1):
                for T in range(B + kv, B * (kv + 1) + 1):  # one request verified kv drafts, the others 1..kv
                    for kc in range(1, K + 1):
                        key = self.key(T, B, kv, kc)
                        if key is not None:
                            keys.add(key)
        for t in (self.ids, self.picks, self.feats):
            t.zero_()
        self.graphs, self.stats = capture_each(sorted(keys, reverse=True), self._body, self.device, pool,
                                               prepare=lambda *key: self.write(key, [], [], [], []))  # type: ignore[arg-type]
        return self.stats
