"""The Triton kernels of the paged attention (triton_backend.py plans their work items)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    Q, K_cache, V_cache, O, PartO, PartLse,
    item_req, item_tok, item_len, item_lo, item_hi, item_part, item_pstride,  # [items] int32
    kv_limit, tree_start, tree_bits,  # [tokens] int32, int32, int64
    path_tab, path_len,  # [tokens, 64], [tokens] int32: exact trees' paths (path_table_kernel)
    counts,  # [2] int32: the step's work items, merges
    block_table,  # [max_seqs, max_blocks] int32
    bt_stride, qk_scale,  # qk_scale = softmax scale * log2(e)
    window,  # WINDOWED: a key at position k is hidden from a query at position p when p - k >= window
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,  # K and V caches share their layout
    stride_pi, stride_ph,  # partial outputs: [parts, kv_heads, BLOCK_M, HEAD_DIM]; lse: [parts, kv_heads, BLOCK_M]
    G: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EXACT: tl.constexpr,  # steps with exact trees: path tiles, and items looped up to the planned count
    WINDOWED: tl.constexpr,  # a sliding-window layer's launch (``window`` read)
):
    kvh = tl.program_id(1)
    if EXACT:
        n_items = tl.load(counts)
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            _attend_item(item, kvh, Q, K_cache, V_cache, O, PartO, PartLse,
                         item_req, item_tok, item_len, item_lo, item_hi, item_part, item_pstride,
                         kv_limit, tree_start, tree_bits, path_tab, path_len, block_table, bt_stride, qk_scale, window,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
                         stride_pi, stride_ph, G, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, PAGE, DOT_PRECISION, True,
                         WINDOWED)
    else:  # (one item a program: the plain kernel, as fast as before exact trees)
        _attend_item(tl.program_id(0), kvh, Q, K_cache, V_cache, O, PartO, PartLse,
                     item_req, item_tok, item_len, item_lo, item_hi, item_part, item_pstride,
                     kv_limit, tree_start, tree_bits, path_tab, path_len, block_table, bt_stride, qk_scale, window,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
                     stride_pi, stride_ph, G, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, PAGE, DOT_PRECISION, False, WINDOWED)


@triton.jit
def path_table_kernel(tree_bits, path_tab, path_len):
    """Once per step with exact trees (program t: token t): ``path_tab[t, r]`` = the bit index of the
    r-th set bit of the token's tree row (its ancestors root first, then itself), ``path_len[t]`` =
    how many. Every layer's attention then maps a tree token's virtual keys with one load."""
    t = tl.program_id(0)
    bits = tl.load(tree_bits + t)
    b = tl.arange(0, 64)
    flag = ((bits >> b.to(tl.int64)) & 1).to(tl.int32)
    rank = tl.cumsum(flag, axis=0) - flag  # set bits below bit b
    tl.store(path_tab + t * 64 + rank, b, mask=flag != 0)
    tl.store(path_len + t, tl.sum(flag, axis=0))


@triton.jit
def _popcount(x):
    """Set bits of each int64 (bit 63 too: the arithmetic shifts' sign bits are masked off)."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return (x & 0x7F).to(tl.int32)


@triton.jit
def _key_block(j, hi, q, m_i, l_i, acc, limit, window, qend, tstart, bits, req, kvh, K_cache, V_cache,
               block_table, bt_stride, qk_scale, stride_kb, stride_ks, stride_kh, d, d_ok,
               path, path_base, path_end, PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr, EXACT: tl.constexpr,
               WINDOWED: tl.constexpr):
    """One block of keys ``j`` into the online softmax. EXACT: keys in [path_base, path_end) are the
    tree token's path (virtual key ``path_base + r`` is read at ``path_base + path[r]``). WINDOWED:
    keys at positions below ``qend - window`` (qend: each row's position + 1) are hidden."""
    j_ok = j < hi
    pos = j
    if EXACT:
        on_path = (j >= path_base) & (j < path_end)
        pos = tl.where(j >= path_base, path_base + tl.load(path + (j - path_base), mask=on_path, other=0), j)
    blk = tl.load(block_table + req * bt_stride + pos // PAGE, mask=j_ok, other=0).to(tl.int64)
    kv_off = blk * stride_kb + (pos % PAGE) * stride_ks + kvh * stride_kh
    kv_mask = j_ok[:, None] & d_ok[None, :]
    # (an 8-bit float cache is widened to the queries' dtype: the same products as a bf16 cache's)
    k = tl.load(K_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale

    jj = j[None, :]
    shift = tl.minimum(tl.maximum(jj - tstart[:, None], 0), 63).to(tl.int64)
    in_tree = ((bits[:, None] >> shift) & 1) != 0
    allowed = (jj < limit[:, None]) & ((jj < tstart[:, None]) | in_tree)
    if WINDOWED:  # a tree key's position: tree_start + its depth, the rank of its bit in the row (ancestors
        # come before their descendants: row 0b1011, key bit 3 -> tree_start + 2)
        below = bits[:, None] & ((tl.full(shift.shape, 1, tl.int64) << shift) - 1)
        kpos = tl.where(jj < tstart[:, None], jj, tstart[:, None] + _popcount(below))
        allowed = allowed & (kpos >= qend[:, None] - window)
    s = tl.where(allowed, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(V_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_item(
    item, kvh, Q, K_cache, V_cache, O, PartO, PartLse,
    item_req, item_tok, item_len, item_lo, item_hi, item_part, item_pstride,
    kv_limit, tree_start, tree_bits, path_tab, path_len, block_table, bt_stride, qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
    stride_pi, stride_ph,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EXACT: tl.constexpr, WINDOWED: tl.constexpr,
):
    n_q = tl.load(item_len + item)
    req = tl.load(item_req + item).to(tl.int64)
    t0 = tl.load(item_tok + item)
    lo = tl.load(item_lo + item)
    hi = tl.load(item_hi + item)
    part = tl.load(item_part + item)

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
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked chunk leaves no NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    path = path_tab  # (the plain variant reads no path: keys map to themselves)
    path_base = hi
    path_end = hi
    if EXACT:
        # one tree token alone in its tile: its keys are the prefix then its path, at consecutive
        # (virtual) positions, as plain decoding will hold them (module docstring: exact trees)
        base = tl.load(tree_start + t0)
        if (n_q == 1) & (base < tl.load(kv_limit + t0)):
            path_end = base + tl.load(path_len + t0)
            limit = tl.zeros_like(limit) + path_end
            tstart = limit
            path = path_tab + t0.to(tl.int64) * 64
            path_base = base
    # each row's position + 1: a tree token's is tree_start + its depth + 1, the set bits of its row (an
    # exact tree's path tile counts its keys at their positions: tree_start = limit = position + 1)
    qend = limit  # (read by WINDOWED launches only)
    if WINDOWED:  # key blocks wholly below every row's window are skipped (kept aligned to BLOCK_N)
        qend = tl.where(tstart < limit, tstart + _popcount(bits), limit)
        lo = tl.maximum(lo, (tl.min(tl.where(row_ok, qend, hi), axis=0) - window) // BLOCK_N * BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _key_block(j, hi, q, m_i, l_i, acc, limit, window, qend, tstart, bits, req, kvh, K_cache,
                                   V_cache, block_table, bt_stride, qk_scale, stride_kb, stride_ks, stride_kh,
                                   d, d_ok, path, path_base, path_end, PAGE, DOT_PRECISION, EXACT, WINDOWED)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    io_mask = row_ok[:, None] & d_ok[None, :]
    tl.store(O + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(O.dtype.element_ty), mask=io_mask & (part < 0))
    # one of several work items of its tile: partial output + log2-sum-exp for the merge kernel
    lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
    if EXACT:  # pstride > 0: each token's rows go to its own part slots (exact trees merge per token)
        pstride = tl.load(item_pstride + item)
        slot = (tl.maximum(part, 0) + q_off * pstride).to(tl.int64)
        prow = tl.where(pstride > 0, rows - q_off * G, rows)
        tl.store(PartO + slot[:, None] * stride_pi + kvh * stride_ph + prow[:, None] * HEAD_DIM + d[None, :], out,
                 mask=io_mask & (part >= 0))
        tl.store(PartLse + slot * (stride_pi // HEAD_DIM) + kvh * BLOCK_M + prow, lse, mask=row_ok & (part >= 0))
    else:
        slot = tl.maximum(part, 0).to(tl.int64)
        tl.store(PartO + slot * stride_pi + kvh * stride_ph + rows[:, None] * HEAD_DIM + d[None, :], out,
                 mask=io_mask & (part >= 0))
        tl.store(PartLse + slot * (stride_pi // HEAD_DIM) + kvh * BLOCK_M + rows, lse, mask=row_ok & (part >= 0))


@triton.jit
def merge_kernel(
    PartO, PartLse, O,
    merge_tok, merge_len, merge_first, merge_count,  # [split tiles] int32
    counts,  # [2] int32: the step's work items, merges
    stride_ot, stride_oh, stride_pi, stride_ph,
    G: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    EXACT: tl.constexpr,
):
    kvh = tl.program_id(1)
    if EXACT:
        n_merges = tl.load(counts + 1)
        for t in range(tl.program_id(0), n_merges, tl.num_programs(0)):
            _merge_tile(t, kvh, PartO, PartLse, O, merge_tok, merge_len, merge_first, merge_count,
                        stride_ot, stride_oh, stride_pi, stride_ph, G, BLOCK_M, HEAD_DIM, BLOCK_D)
    else:
        _merge_tile(tl.program_id(0), kvh, PartO, PartLse, O, merge_tok, merge_len, merge_first, merge_count,
                    stride_ot, stride_oh, stride_pi, stride_ph, G, BLOCK_M, HEAD_DIM, BLOCK_D)


@triton.jit
def _merge_tile(
    t, kvh, PartO, PartLse, O, merge_tok, merge_len, merge_first, merge_count,
    stride_ot, stride_oh, stride_pi, stride_ph,
    G: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n_q = tl.load(merge_len + t)
    t0 = tl.load(merge_tok + t)
    first = tl.load(merge_first + t)
    count = tl.load(merge_count + t)

    rows = tl.arange(0, BLOCK_M)
    q_off = rows // G
    row_ok = (q_off < n_q) & (count > 0)
    tok = (t0 + q_off).to(tl.int64)
    head = kvh * G + rows % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    wsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for i in range(0, count):
        slot = (first + i).to(tl.int64)
        lse = tl.load(PartLse + slot * (stride_pi // HEAD_DIM) + kvh * BLOCK_M + rows, mask=row_ok,
                      other=float("-inf"))
        o = tl.load(PartO + slot * stride_pi + kvh * stride_ph + rows[:, None] * HEAD_DIM + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + w[:, None] * o
        wsum = wsum * alpha + w
        m = m_new
    out = acc / tl.where(wsum > 0, wsum, 1.0)[:, None]
    tl.store(O + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
