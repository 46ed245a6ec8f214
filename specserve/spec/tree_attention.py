"""Attention for the draft head while it grows a tree.

Each request has the same number of frontier queries per step (topk). A query attends to the
request's committed draft KV (paged, positions < prefix_len) and to the draft KV of its
ancestors among the tree queries of earlier steps, plus itself. Tree-query K/V live in dense
per-step buffers here, never in the paged cache, so the tree leaves nothing behind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionBackend


class TreeDraftBackend(AttentionBackend):
    def begin(self, block_tables: list[list[int]], prefix_lens: list[int], topk: int) -> None:
        dev = self.kv_caches[0][0].device
        B = len(prefix_lens)
        P = max(prefix_lens)
        bs = self.block_size
        j = torch.arange(P)
        width = max(len(t) for t in block_tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        slots = bt.gather(1, (j // bs).clamp(max=width - 1)[None].expand(B, -1)) * bs + (j % bs)[None]
        valid = j[None] < torch.tensor(prefix_lens)[:, None]
        self._prefix_slots = torch.where(valid, slots, torch.zeros_like(slots)).to(dev)
        self._prefix_valid = valid.to(dev)  # [B, P]
        self._B, self._K = B, topk
        self._node_k: dict[int, torch.Tensor] = {}
        self._node_v: dict[int, torch.Tensor] = {}
        self._anc: torch.Tensor | None = None

    def set_ancestors(self, anc: torch.Tensor) -> None:
        """anc bool [B, K, n_prev]: which earlier tree queries each current query descends from."""
        self._anc = anc

    def plan(self, meta) -> None:  # the tree steps are planned through begin/set_ancestors
        raise NotImplementedError("TreeDraftBackend is driven by begin() and set_ancestors()")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, K = self._B, self._K
        k_cache, v_cache = self.kv_caches[layer]
        kvh, d = k_cache.shape[-2:]
        h = q.shape[1]
        pk = k_cache.view(-1, kvh, d)[self._prefix_slots]  # [B, P, kvh, d]
        pv = v_cache.view(-1, kvh, d)[self._prefix_slots]
        k = k.view(B, K, kvh, d).to(pk.dtype)
        v = v.view(B, K, kvh, d).to(pv.dtype)
        prev_k = self._node_k.get(layer)
        prev_v = self._node_v.get(layer)
        n_prev = 0 if prev_k is None else prev_k.shape[1]
        keys = [pk] + ([prev_k] if n_prev else []) + [k]
        vals = [pv] + ([prev_v] if n_prev else []) + [v]
        self._node_k[layer] = k if prev_k is None else torch.cat([prev_k, k], 1)
        self._node_v[layer] = v if prev_v is None else torch.cat([prev_v, v], 1)
        eye = torch.eye(K, dtype=torch.bool, device=q.device)[None].expand(B, -1, -1)
        parts = [self._prefix_valid[:, None, :].expand(-1, K, -1)]
        if n_prev:
            parts.append(self._anc)
        parts.append(eye)
        mask = torch.cat(parts, dim=2)[:, None]  # [B, 1, K, P + n_prev + K]
        qq = q.view(B, K, h, d).transpose(1, 2)
        kk = torch.cat(keys, 1).transpose(1, 2).to(qq.dtype)
        vv = torch.cat(vals, 1).transpose(1, 2).to(qq.dtype)
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=self.scale, enable_gqa=h != kvh)
        return out.transpose(1, 2).reshape(B * K, h, d)
