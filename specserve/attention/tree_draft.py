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
from specserve.engine.kv_cache import kv_slot


class TreeDraftBackend(AttentionBackend):
    def begin(self, block_tables: list[list[int]], prefix_lens: list[int], topk: int) -> None:
        dev = self.kv_caches[0][0].device
        B = len(prefix_lens)
        P = max(prefix_lens)
        bs = self.block_size
        j = torch.arange(P)
        width = max(len(t) for t in block_tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        slots = kv_slot(bt, j[None], bs, torch.arange(B)[:, None], width - 1)
        valid = j[None] < torch.tensor(prefix_lens)[:, None]
        self._prefix_slots = torch.where(valid, slots, torch.zeros_like(slots)).to(dev)
        self._prefix_valid = valid.to(dev)  # [B, P]
        self._B, self._K = B, topk
        self._eye = torch.eye(topk, dtype=torch.bool, device=dev)[None].expand(B, -1, -1)  # each query sees itself
        # per layer: K/V buffers [B, P + tree nodes so far (+ room), kvh, d], the prefix gathered
        # once per draft step (it does not change while the tree grows)
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.set_ancestors(None)

    def set_ancestors(self, anc: torch.Tensor | None) -> None:
        """anc bool [B, K, n_prev]: which earlier tree queries each current query descends from
        (None at the first depth). Builds this depth's mask, the same for every layer."""
        K = self._K
        self._n_prev = 0 if anc is None else anc.shape[2]
        parts = [self._prefix_valid[:, None, :].expand(-1, K, -1)] + ([anc] if anc is not None else []) + [self._eye]
        self._mask = torch.cat(parts, dim=2)[:, None]  # [B, 1, K, P + n_prev + K]

    def plan(self, meta) -> None:  # the tree steps are planned through begin/set_ancestors
        raise NotImplementedError("TreeDraftBackend is driven by begin() and set_ancestors()")

    def _buffers(self, layer: int, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V buffers with room for ``need`` entries (prefix + nodes)."""
        buf = self._kv.get(layer)
        if buf is not None and buf[0].shape[1] >= need:
            return buf
        k_cache, v_cache = self.kv_caches[layer]
        kvh, d = k_cache.shape[-2:]
        P = self._prefix_slots.shape[1]
        cap = max(need, P + 8 * self._K)
        kb = k_cache.new_empty(self._B, cap, kvh, d)
        vb = v_cache.new_empty(self._B, cap, kvh, d)
        if buf is None:
            kb[:, :P] = k_cache.view(-1, kvh, d)[self._prefix_slots]
            vb[:, :P] = v_cache.view(-1, kvh, d)[self._prefix_slots]
        else:  # everything before this depth is written
            have = P + self._n_prev
            kb[:, :have] = buf[0][:, :have]
            vb[:, :have] = buf[1][:, :have]
        self._kv[layer] = (kb, vb)
        return kb, vb

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, K = self._B, self._K
        start = self._prefix_slots.shape[1] + self._n_prev  # this depth's nodes go here
        S = start + K
        kb, vb = self._buffers(layer, S)
        kvh, d = kb.shape[-2:]
        h = q.shape[1]
        kb[:, start:S] = k.view(B, K, kvh, d)
        vb[:, start:S] = v.view(B, K, kvh, d)
        qq = q.view(B, K, h, d).transpose(1, 2)
        kk = kb[:, :S].transpose(1, 2).to(qq.dtype)
        vv = vb[:, :S].transpose(1, 2).to(qq.dtype)
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=self._mask, scale=self.scale,
                                             enable_gqa=h != kvh)
        return out.transpose(1, 2).reshape(B * K, h, d)
