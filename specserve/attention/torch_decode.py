"""Decode attention with all metadata on the device, in plain PyTorch: the draft loop's on the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionBackend, AttentionMetadata, gather_kv, write_kv
from specserve.engine.kv_cache import kv_slot


class TorchDecodeAttention(AttentionBackend):
    """``TritonDecodeAttention``'s interface in plain PyTorch, computing what ``TorchNativeBackend`` does for a
    decode step; ``max_kv`` (eager only) limits the keys gathered, else the whole block-table row is read."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, scale: float,
                 block_tables: torch.Tensor) -> None:
        super().__init__(kv_caches, block_size, scale)
        self.block_tables = block_tables
        self._slots: torch.Tensor | None = None
        self._seq: torch.Tensor | None = None
        self._max_kv: int | None = None

    def plan(self, meta: AttentionMetadata) -> None:  # pragma: no cover - the interface's host path
        raise NotImplementedError("TorchDecodeAttention takes device metadata through set_step()")

    def set_step(self, slots: torch.Tensor, seq_lens: torch.Tensor, max_kv: int | None = None) -> None:
        self._slots, self._seq, self._max_kv = slots, seq_lens, max_kv

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self._slots is not None and self._seq is not None, "set_step() first"
        k_flat, v_flat = write_kv(self.kv_caches[layer], self._slots, k, v)
        kvh, d = k_flat.shape[1:]
        B, h = q.shape[0], q.shape[1]
        bt = self.block_tables[:B]
        L = self._max_kv if self._max_kv is not None else bt.shape[1] * self.block_size
        kj = torch.arange(L, device=q.device)
        kv_slots = kv_slot(bt, kj[None, :], self.block_size, torch.arange(B, device=q.device)[:, None])
        valid = kj[None, :] < self._seq[:, None]
        kv_slots = torch.where(valid, kv_slots, torch.zeros_like(kv_slots))
        qp = q[:, None].transpose(1, 2)  # [B, H, 1, D]
        kp = gather_kv(k_flat, kv_slots).transpose(1, 2)  # [B, KVH, L, D]
        vp = gather_kv(v_flat, kv_slots).transpose(1, 2)
        out = F.scaled_dot_product_attention(qp, kp.to(qp.dtype), vp.to(qp.dtype), attn_mask=valid[:, None, None, :],
                                             scale=self.scale, enable_gqa=h != kvh)
        return out.transpose(1, 2).reshape(B, h, d)
