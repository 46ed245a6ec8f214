"""Paged attention in Triton (the GPU backend), graph-friendly.

One program handles one *tile* (up to ``block_q`` consecutive query tokens of one request) for
one KV head: its rows are the tile's tokens times the query heads that share that KV head (GQA),
so decode (1 token), verify (1+k) and prefill chunks all run through one kernel. Keys and values
are read through the block table, a ``block_n``-key chunk at a time, with an online softmax.

Masking is per query token, from three numbers the plan writes:
  ``kv_limit``   keys at positions >= kv_limit are never seen (causal: own position + 1),
  ``tree_start`` keys below it are the committed prefix, always visible,
  ``tree_bits``  bit i set: the token sees the request's i-th new token (key tree_start + i).
A causal token has tree_start = kv_limit, so its bits are never consulted. A request with a tree
mask has kv_limit = seq_len and tree_start = seq_len - q_len for all its tokens (trees of at most
64 tokens: the bits are one int64).

CUDA graphs: ``plan`` writes every per-step number into preallocated device buffers (one packed
host->device copy plus device->device copies; no host sync), and ``forward`` only reads them, so
a graph captured once replays with any step's metadata. Captured launches use one program per
token slot (tiles <= tokens); unused programs find ``tile_len == 0`` and store nothing. Tokens past
the step's real count (padding up to a captured size) write their K/V into ``scratch_slot``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import triton
import triton.language as tl

from specserve.attention.base import AttentionBackend, AttentionMetadata

MAX_TREE_TOKENS = 64  # tree masks are packed into one int64 per token
GRAPH_BLOCK_M = 16  # rows per program for steps of <= LARGE_STEP_TOKENS tokens (all captured sizes)
LARGE_BLOCK_M = 64  # rows per program for larger (prefill-heavy, eager) steps
LARGE_STEP_TOKENS = 512
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    Q, K_cache, V_cache, O,
    tile_req, tile_tok, tile_len, tile_kv_end,  # [tiles] int32: request, first token, tokens, keys seen
    kv_limit, tree_start, tree_bits,  # [tokens] int32, int32, int64
    block_table,  # [max_seqs, max_blocks] int32
    bt_stride, qk_scale,  # qk_scale = softmax scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,  # K and V caches share their layout
    G: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    n_q = tl.load(tile_len + tile)
    req = tl.load(tile_req + tile).to(tl.int64)
    t0 = tl.load(tile_tok + tile)

    rows = tl.arange(0, BLOCK_M)
    q_off = rows // G
    row_ok = q_off < n_q
    tok = (t0 + q_off).to(tl.int64)
    head = kvh * G + rows % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    limit = tl.load(kv_limit + tok, mask=row_ok, other=0)
    tstart = tl.load(tree_start + tok, mask=row_ok, other=0)
    bits = tl.load(tree_bits + tok, mask=row_ok, other=0)
    kv_end = tl.load(tile_kv_end + tile)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked chunk leaves no NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < kv_end
        blk = tl.load(block_table + req * bt_stride + j // PAGE, mask=j_ok, other=0).to(tl.int64)
        kv_off = blk * stride_kb + (j % PAGE) * stride_ks + kvh * stride_kh
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(K_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale

        jj = j[None, :]
        shift = tl.minimum(tl.maximum(jj - tstart[:, None], 0), 63).to(tl.int64)
        in_tree = ((bits[:, None] >> shift) & 1) != 0
        allowed = (jj < limit[:, None]) & ((jj < tstart[:, None]) | in_tree)
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _pack_rows(mask: np.ndarray) -> np.ndarray:
    """bool [q, q] (q <= 64) -> int64 [q]: bit j of row i set iff mask[i, j]."""
    q = mask.shape[1]
    weights = np.left_shift(np.ones(q, dtype=np.uint64), np.arange(q, dtype=np.uint64))
    return (mask.astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64).view(np.int64)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonBackend(AttentionBackend):
    """Paged attention with persistent metadata buffers (see the module docstring).

    Capacity is fixed at construction: ``max_num_tokens`` tokens and ``max_num_seqs`` requests
    per step, ``max_blocks_per_seq`` block-table entries per request. ``scratch_slot`` is a
    cache slot no request owns (the runner reserves one block for it); padded tokens write there.
    """

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, scale: float, *,
                 num_heads: int, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 scratch_slot: int | None = None, block_n: int = 64, num_warps: int = 4,
                 num_stages: int | None = None) -> None:
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
        self.num_stages = num_stages  # None: Triton's default
        self.device = k0.device
        dev = self.device

        # packed int32 metadata, one host->device copy per step: 6 sections of max_num_tokens
        n = max_num_tokens
        self._meta = torch.zeros(6 * n, dtype=torch.int32, device=dev)
        (self._tile_req, self._tile_tok, self._tile_len, self._tile_kv_end, self._kv_limit,
         self._tree_start) = self._meta.split(n)
        self._tree_bits = torch.zeros(n, dtype=torch.int64, device=dev)
        self._block_table = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self._pin = dev.type == "cuda"
        self._num_tiles = 0
        self._num_tokens = 0
        self._block_m = GRAPH_BLOCK_M

    # -- per step ----------------------------------------------------------------------------
    def block_m_for(self, num_tokens: int) -> int:
        """Rows per program: a pure function of the step's token count, so a graph captured for a
        padded size and the plan of any step that replays it agree."""
        bm = GRAPH_BLOCK_M if num_tokens <= LARGE_STEP_TOKENS else LARGE_BLOCK_M
        return max(bm, _next_pow2(self.group))

    def plan(self, meta: AttentionMetadata) -> None:
        q_lens = np.asarray(meta.query_lens, dtype=np.int64)
        seq_lens = np.asarray(meta.seq_lens, dtype=np.int64)
        B = len(q_lens)
        if B == 0 or len(seq_lens) != B:
            raise ValueError(f"need one seq_len per request: {B} query_lens, {len(seq_lens)} seq_lens")
        if (q_lens < 1).any() or (seq_lens < q_lens).any():
            raise ValueError("every request needs query_len >= 1 and seq_len >= query_len")
        T = int(q_lens.sum())
        if T > self.max_num_tokens:
            raise ValueError(f"step has {T} tokens; this backend was sized for {self.max_num_tokens}")
        if B > self.max_num_seqs:
            raise ValueError(f"step has {B} requests; this backend was sized for {self.max_num_seqs}")
        bt = meta.block_tables
        if bt.shape[0] != B or bt.shape[1] > self.max_blocks_per_seq:
            raise ValueError(f"block table {tuple(bt.shape)} does not fit {B} requests x {self.max_blocks_per_seq} blocks")
        if int(seq_lens.max()) > bt.shape[1] * self.block_size:
            raise ValueError("a seq_len exceeds its block table")
        if meta.slot_mapping.shape[0] != T:
            raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} entries for {T} tokens")

        bq = self.block_m_for(T) // self.group
        starts = np.cumsum(q_lens) - q_lens
        req_of_tok = np.repeat(np.arange(B), q_lens)
        idx_in_req = np.arange(T) - starts[req_of_tok]
        kv_limit = seq_lens[req_of_tok] - q_lens[req_of_tok] + idx_in_req + 1
        tree_start = kv_limit.copy()

        n_tiles = (q_lens + bq - 1) // bq
        tile_req = np.repeat(np.arange(B), n_tiles)
        tile_idx = np.arange(int(n_tiles.sum())) - (np.cumsum(n_tiles) - n_tiles)[tile_req]
        tile_tok = starts[tile_req] + tile_idx * bq
        tile_len = np.minimum(bq, q_lens[tile_req] - tile_idx * bq)

        trees = meta.tree_masks or {}
        for b, tm in trees.items():
            ql, sl = int(q_lens[b]), int(seq_lens[b])
            if tuple(tm.shape) != (ql, ql):
                raise ValueError(f"tree mask of request {b} has shape {tuple(tm.shape)}, expected {(ql, ql)}")
            if ql > MAX_TREE_TOKENS:
                raise ValueError(f"tree of request {b} has {ql} tokens; at most {MAX_TREE_TOKENS} are supported")
            s = int(starts[b])
            kv_limit[s : s + ql] = sl
            tree_start[s : s + ql] = sl - ql

        n = self.max_num_tokens
        host = torch.zeros(6 * n, dtype=torch.int32, pin_memory=self._pin)
        h = host.numpy()
        nt = len(tile_req)
        h[0:nt] = tile_req
        h[n : n + nt] = tile_tok
        h[2 * n : 2 * n + nt] = tile_len
        h[3 * n : 3 * n + nt] = kv_limit[tile_tok + tile_len - 1]  # the tile's last token sees the most keys
        h[4 * n : 4 * n + T] = kv_limit
        h[5 * n : 5 * n + T] = tree_start
        self._meta.copy_(host, non_blocking=True)

        # tree bits: only tokens of tree requests read theirs, so stale entries elsewhere are harmless
        for b, tm in trees.items():
            ql, s = int(q_lens[b]), int(starts[b])
            if tm.device.type == "cpu":
                bits = torch.from_numpy(_pack_rows(tm.numpy().astype(bool)))
                if self._pin:
                    bits = bits.pin_memory()
            else:
                weights = torch.ones(ql, dtype=torch.int64, device=tm.device).bitwise_left_shift_(
                    torch.arange(ql, dtype=torch.int64, device=tm.device))
                bits = (tm.to(torch.int64) * weights).sum(-1)
            self._tree_bits[s : s + ql].copy_(bits, non_blocking=True)

        self._block_table[:B, : bt.shape[1]].copy_(bt, non_blocking=True)
        self._slots[:T].copy_(meta.slot_mapping, non_blocking=True)
        self._slots[T:].fill_(self.scratch_slot)
        self._num_tiles = nt
        self._num_tokens = T
        self._block_m = self.block_m_for(T)

    # -- per layer ---------------------------------------------------------------------------
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        n = q.shape[0]
        slots = self._slots[:n]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v.to(v_cache.dtype))

        if q.dtype != k_cache.dtype:
            q = q.to(k_cache.dtype)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        # captured launches cover every token slot; eager ones exactly the planned tiles
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        grid = (n if capturing else self._num_tiles, self.num_kv_heads)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out,
            self._tile_req, self._tile_tok, self._tile_len, self._tile_kv_end,
            self._kv_limit, self._tree_start, self._tree_bits,
            self._block_table, self._block_table.stride(0), self.scale * _LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            G=self.group, BLOCK_M=self._block_m, BLOCK_N=self.block_n,
            HEAD_DIM=self.head_dim, BLOCK_D=max(16, _next_pow2(self.head_dim)), PAGE=self.block_size,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=self.num_warps, **({} if self.num_stages is None else {"num_stages": self.num_stages}),
        )
        return out


def max_blocks_per_seq(max_model_len: int, block_size: int, num_blocks: int) -> int:
    return min(num_blocks, math.ceil(max_model_len / block_size))
