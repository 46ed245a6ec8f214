"""Attention backends for training: no paged cache, one padded [B, L] batch flattened to [B*L].

- ``DenseCausalBackend``: plain causal prefill (the target's feature pass), sliding windows applied.
- ``TTTBackend``: EAGLE-3's training-time test. Step 0 is causal over the real features; at step
  i > 0 the query at position t attends to step-0 keys 0..t plus the keys of steps 1..i at the
  same position t (what the draft KV cache holds when drafting i steps ahead from t).

Rows are right-padded, so causal masking alone keeps valid queries off the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionBackend, AttentionMetadata


def _to_bhld(x: torch.Tensor, B: int, L: int) -> torch.Tensor:
    """[B*L, heads, D] -> [B, heads, L, D]."""
    return x.view(B, L, x.shape[1], x.shape[2]).transpose(1, 2)


def _from_bhld(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, L, D] -> [B*L, heads, D]."""
    B, h, L, D = x.shape
    return x.transpose(1, 2).reshape(B * L, h, D)


class DenseCausalBackend(AttentionBackend):
    def __init__(self, batch: int, seq_len: int, scale: float) -> None:
        super().__init__([], block_size=1, scale=scale)
        self.B, self.L = batch, seq_len

    def plan(self, meta: AttentionMetadata) -> None:  # nothing to plan: the shape is fixed
        pass

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        qb, kb, vb = (_to_bhld(t, self.B, self.L) for t in (q, k, v))
        mask = None if window is None or self.L <= window else window_causal_mask(self.L, window, q.device)
        out = F.scaled_dot_product_attention(qb, kb.to(qb.dtype), vb.to(qb.dtype), attn_mask=mask,
                                             is_causal=mask is None, scale=self.scale,
                                             enable_gqa=qb.shape[1] != kb.shape[1])
        return _from_bhld(out)


def window_causal_mask(L: int, window: int, device: torch.device) -> torch.Tensor:
    """[L, L] bool: query p sees key j when 0 <= p - j < window (a sliding-window layer)."""
    d = torch.arange(L, device=device)[:, None] - torch.arange(L, device=device)[None, :]
    return (d >= 0) & (d < window)


class TTTBackend(AttentionBackend):
    """Call ``forward`` once per unrolled step, in order (the draft head has one attention layer)."""

    def __init__(self, batch: int, seq_len: int, scale: float) -> None:
        super().__init__([], block_size=1, scale=scale)
        self.B, self.L = batch, seq_len
        self.keys: list[torch.Tensor] = []  # per step [B, KVH, L, D]
        self.values: list[torch.Tensor] = []

    def plan(self, meta: AttentionMetadata) -> None:
        pass

    @property
    def step(self) -> int:
        return len(self.keys)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer != 0:
            raise ValueError("TTTBackend serves a one-layer EAGLE-3 head (layer 0)")
        B, L = self.B, self.L
        qb, kb, vb = (_to_bhld(t, B, L) for t in (q, k, v))
        self.keys.append(kb)
        self.values.append(vb)
        h, kvh = qb.shape[1], kb.shape[1]
        rep = h // kvh

        def expand(x: torch.Tensor) -> torch.Tensor:
            return x.repeat_interleave(rep, dim=1) if rep > 1 else x

        k0, v0 = expand(self.keys[0]).to(qb.dtype), expand(self.values[0]).to(qb.dtype)
        if len(self.keys) == 1:
            out = F.scaled_dot_product_attention(qb, k0, v0, is_causal=True, scale=self.scale)
            return _from_bhld(out)
        # step i: causal scores against step-0 keys, plus one "diagonal" score per later step
        s0 = torch.matmul(qb, k0.transpose(-1, -2)).float() * self.scale  # [B, H, L, L]
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        s0 = s0.masked_fill(~causal, float("-inf"))
        later_k = [expand(kj).to(qb.dtype) for kj in self.keys[1:]]
        later_v = [expand(vj).to(qb.dtype) for vj in self.values[1:]]
        diag = torch.stack([(qb * kj).sum(-1).float() * self.scale for kj in later_k], dim=-1)  # [B,H,L,i]
        probs = torch.softmax(torch.cat([s0, diag], dim=-1), dim=-1)
        p0, pd = probs[..., :L], probs[..., L:]
        out = torch.matmul(p0.to(v0.dtype), v0).float()
        for j, vj in enumerate(later_v):
            out = out + pd[..., j : j + 1] * vj.float()
        return _from_bhld(out.to(qb.dtype))
