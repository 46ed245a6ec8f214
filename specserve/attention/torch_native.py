"""Reference attention backend in plain PyTorch (CPU default; correctness reference on GPU).

The ragged batch is padded to [B, max_q] queries and [B, max_kv] keys once per step; every
layer then runs one batched scaled_dot_product_attention with a boolean mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionBackend, AttentionMetadata, write_kv


class TorchNativeBackend(AttentionBackend):
    def plan(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        B = len(meta.query_lens)
        q_lens = torch.tensor(meta.query_lens, dtype=torch.long)
        kv_lens = torch.tensor(meta.seq_lens, dtype=torch.long)
        max_q = int(q_lens.max())
        max_kv = int(kv_lens.max())
        T = int(q_lens.sum())

        # query padding: [B, max_q] -> flat token index, pad rows point at a zero row T
        starts = torch.cumsum(q_lens, 0) - q_lens
        qi = torch.arange(max_q)
        q_valid = qi[None, :] < q_lens[:, None]
        q_index = torch.where(q_valid, starts[:, None] + qi[None, :], torch.full_like(q_valid, T, dtype=torch.long))

        # key gather: [B, max_kv] -> cache slot
        kj = torch.arange(max_kv)
        bt = meta.block_tables.to("cpu", torch.long)
        blk = bt.gather(1, (kj // self.block_size).clamp(max=bt.shape[1] - 1)[None, :].expand(B, -1))
        kv_slots = blk * self.block_size + (kj % self.block_size)[None, :]
        kv_valid = kj[None, :] < kv_lens[:, None]
        kv_slots = torch.where(kv_valid, kv_slots, torch.zeros_like(kv_slots))

        # mask: query i of request b sits at kv position kv_len - q_len + i
        q_pos = (kv_lens - q_lens)[:, None] + qi[None, :]
        mask = (kj[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
        for b, tm in (meta.tree_masks or {}).items():
            ql, kl = meta.query_lens[b], meta.seq_lens[b]
            if tm.shape != (ql, ql):
                raise ValueError(f"tree mask of request {b} has shape {tuple(tm.shape)}, expected {(ql, ql)}")
            mask[b, :ql, kl - ql : kl] = tm.to("cpu", torch.bool)
        mask[~q_valid] = False
        mask[:, :, 0] |= ~q_valid  # padded query rows attend something, avoiding NaN

        self._q_index = q_index.to(device)
        # flat position of each real query in the padded [B * max_q] layout (no mask indexing per layer)
        self._q_flat = q_valid.reshape(-1).nonzero()[:, 0].to(device)
        self._kv_slots = kv_slots.to(device)
        self._mask = mask[:, None].to(device)
        self._slot_mapping = meta.slot_mapping
        self._shape = (B, max_q, max_kv)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_flat, v_flat = write_kv(self.kv_caches[layer], self._slot_mapping, k, v)
        kvh, d = k_flat.shape[1:]

        B, max_q, max_kv = self._shape
        h = q.shape[1]
        q_ext = torch.cat([q, q.new_zeros(1, h, d)], 0)
        qp = q_ext[self._q_index].transpose(1, 2)  # [B, H, max_q, D]
        kp = k_flat[self._kv_slots].transpose(1, 2)  # [B, KVH, max_kv, D]
        vp = v_flat[self._kv_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qp, kp.to(qp.dtype), vp.to(qp.dtype), attn_mask=self._mask, scale=self.scale, enable_gqa=h != kvh
        )
        return out.transpose(1, 2).reshape(B * max_q, h, d)[self._q_flat]  # [T, H, D] in flat order
