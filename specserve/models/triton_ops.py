"""Triton kernels for the decoder's elementwise work on the GPU: one launch where torch takes several.

Each elementwise kernel costs a few microseconds however little it does (docs/decisions.md: a layer's
~23 kernels, 4 of them matmuls). These fuse them:

- ``add_rms_norm``: residual add + RMSNorm + weight (3 kernels -> 1);
- ``silu_mul``: SiLU(gate) * up over the fused gate_up output (2 -> 1);
- ``rope_and_cache``: rotary on q and k, and k, v into the paged cache (4 + 2 -> 1; for the draft
  head, whose rotary is fp32 math on cos/sin of each step's positions, ~15 -> 1).

Each rounds where torch rounds (to the activation dtype after the add, after the norm, after each
product), so outputs match the torch ops up to the order of the norm's sum. ``specserve.models.layers``
calls these for CUDA tensors only; the CPU keeps the torch ops (fp32, bit for bit transformers).
This module imports triton: import it lazily (tests run it on the CPU in Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.base import is_fp8


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _add_rms_norm_kernel(X, R, W, Out, Sum, stride_x, stride_r, stride_o, stride_s, N, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(Sum.dtype.element_ty)
        tl.store(Sum + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.rsqrt(var + eps)).to(Out.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    tl.store(Out + row * stride_o + cols, (y.to(tl.float32) * w.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s) * weight, s) with s = x + residual (s = x when residual is None).

    x, residual: [..., N] with a contiguous last dim; the rows are flattened.
    """
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    rows = x2.shape[0]
    out = torch.empty(rows, N, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, N)
        s2 = torch.empty(rows, N, dtype=x.dtype, device=x.device)
    else:
        r2 = s2 = x2
    if rows:
        block = _pow2(N)
        _add_rms_norm_kernel[(rows,)](
            x2, r2, weight, out, s2, x2.stride(0), r2.stride(0), out.stride(0), s2.stride(0), N, eps,
            HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return out.view(x.shape), s2.view(x.shape) if residual is not None else x


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + I + cols, mask=ok, other=0.0)
    a = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + cols, (a.to(tl.float32) * u.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> SiLU(gate) * up [..., I]."""
    two_i = gate_up.shape[-1]
    inter = two_i // 2
    gu = gate_up.reshape(-1, two_i)
    out = torch.empty(gu.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0]:
        block = min(1024, _pow2(inter))
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(inter, block))](
            gu, out, gu.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)


@triton.jit
def _rope_cache_kernel(QKV, Cos, Sin, Q, K_cache, V_cache, Slots, Pos, P,
                       stride_qkv, stride_cos, stride_qt, stride_qh, stride_slot,
                       HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DRAFT: tl.constexpr, KV_MAX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    h_ok = h < HQ + 2 * HK
    ok = h_ok[:, None] & d_ok[None, :]
    src = QKV + t * stride_qkv + h[:, None] * D
    x = tl.load(src + d[None, :], mask=ok, other=0.0)
    # rotate-half with the tables of RotaryEmbedding: x * cos + roll(x, D/2) * sin, sin = [-sin, sin]
    xr = tl.load(src + ((d + D // 2) % D)[None, :], mask=ok, other=0.0)
    if DRAFT:
        # the draft head's apply_rope: cos, sin [P, D/2] (fp32) at the token's position, fp32
        # products and sum (x1 cos - x2 sin, x2 cos + x1 sin), one rounding at the end
        row = tl.minimum(tl.maximum(tl.load(Pos + t).to(tl.int64), 0), P - 1)
        half = d % (D // 2)
        c = tl.load(Cos + row * stride_cos + half, mask=d_ok, other=0.0)
        s = tl.load(Sin + row * stride_cos + half, mask=d_ok, other=0.0)
        s = tl.where(d < D // 2, -s, s)
        rot = (x.to(tl.float32) * c[None, :] + xr.to(tl.float32) * s[None, :]).to(x.dtype)
    else:  # the target's (transformers'): [T, D] tables, rounded to the activation dtype after each product
        c = tl.load(Cos + t * stride_cos + d, mask=d_ok, other=0.0)
        s = tl.load(Sin + t * stride_cos + d, mask=d_ok, other=0.0)
        a = (x.to(tl.float32) * c.to(tl.float32)[None, :]).to(x.dtype)
        b = (xr.to(tl.float32) * s.to(tl.float32)[None, :]).to(x.dtype)
        rot = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
    is_q = h < HQ
    is_k = (h >= HQ) & (h < HQ + HK)
    is_v = h >= HQ + HK
    tl.store(Q + t * stride_qt + h[:, None] * stride_qh + d[None, :], rot.to(Q.dtype.element_ty),
             mask=ok & is_q[:, None])
    slot = tl.load(Slots + t).to(tl.int64)
    kv_head = tl.where(is_k, h - HQ, h - HQ - HK)
    dst = slot * stride_slot + kv_head[:, None] * D + d[None, :]
    k = rot
    v = x
    if KV_MAX > 0:  # an 8-bit float cache: saturated, as attention.base.to_cache_dtype
        k = tl.minimum(tl.maximum(rot.to(tl.float32), -KV_MAX), KV_MAX)
        v = tl.minimum(tl.maximum(x.to(tl.float32), -KV_MAX), KV_MAX)
    tl.store(K_cache + dst, k.to(K_cache.dtype.element_ty), mask=ok & is_k[:, None])
    tl.store(V_cache + dst, v.to(V_cache.dtype.element_ty), mask=ok & is_v[:, None])


def _fp8_max(dtype: torch.dtype) -> float:
    """The largest value of an 8-bit float cache dtype; 0.0 for any other (no saturation)."""
    return float(torch.finfo(dtype).max) if is_fp8(dtype) else 0.0


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (HQ + 2 HK) * D] (q, k, v heads side by side, last dim contiguous), cos/sin [T, 1, D]
    or [T, D] -> rotated q [T, HQ, D]; rotated k and v written at ``slots`` [T] of the paged caches
    [blocks, block_size, HK, D] (contiguous; 8-bit float caches saturate at the format's largest value).

    With ``positions`` [T] (the draft head's, eagle3.DraftAttention.build_rope_tables): cos/sin are
    fp32 tables [P, D/2] read at each token's position (clamped to [0, P - 1]), and the rotation is
    eagle3.apply_rope's fp32 math (no fused multiply-add: bit for bit those torch ops)."""
    T = qkv.shape[0]
    k_cache, v_cache = kv_cache
    if qkv.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("rope_and_cache needs a contiguous last dim and contiguous caches")
    table = positions is not None
    if table:
        if (cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim // 2 or cos.dtype != torch.float32
                or cos.stride(-1) != 1 or sin.stride() != cos.stride()):
            raise ValueError("rope_and_cache with positions needs fp32 cos/sin tables [P, head_dim / 2] of one layout")
        cos2, sin2, pos = cos, sin, positions
    else:
        cos2, sin2, pos = cos.reshape(T, head_dim), sin.reshape(T, head_dim), slots
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T:
        heads = num_heads + 2 * num_kv_heads
        block_h = min(16, _pow2(heads))
        _rope_cache_kernel[(T, triton.cdiv(heads, block_h))](
            qkv, cos2, sin2, q, k_cache, v_cache, slots, pos, cos2.shape[0],
            qkv.stride(0), cos2.stride(0), q.stride(0), q.stride(1), num_kv_heads * head_dim,
            HQ=num_heads, HK=num_kv_heads, D=head_dim, BLOCK_H=block_h, BLOCK_D=_pow2(head_dim),
            DRAFT=table, KV_MAX=_fp8_max(k_cache.dtype), num_warps=4, enable_fp_fusion=not table,
        )
    return q


@triton.jit
def _topk_logprobs_kernel(X, Val, Idx, stride_x, N, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    lse = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
    for j in tl.static_range(K):
        v, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(Val + row * K + j, v - lse)
        tl.store(Idx + row * K + j, i.to(tl.int64))
        x = tl.where(cols == i, -float("inf"), x)


# one program holds a whole row: past this many columns (a full-vocabulary EAGLE-1 head) the
# registers spill, and the caller keeps torch's ops
TOPK_LOGPROBS_MAX_N = 16384


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.log_softmax(logits.float(), -1).topk(k)``: (values [R, k] float32, indices [R, k] int64),
    best first, the lower index first among equal values, in one kernel per call.

    The tree expansion takes each frontier node's top-k children this way (torch's top-k of a few
    8,192-wide rows runs one block per row). logits: [R, N] of any float dtype, N <= TOPK_LOGPROBS_MAX_N.
    """
    R, N = logits.shape
    if N > TOPK_LOGPROBS_MAX_N or not 0 < k <= N:
        raise ValueError(f"topk_logprobs: k={k} of {N} columns (at most {TOPK_LOGPROBS_MAX_N})")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    val = torch.empty(R, k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(R, k, dtype=torch.int64, device=logits.device)
    if R:
        block = _pow2(N)
        _topk_logprobs_kernel[(R,)](logits, val, idx, logits.stride(0), N, K=k, BLOCK=block,
                                    num_warps=min(16, max(1, block // 512)))
    return val, idx
