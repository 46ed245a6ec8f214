"""Decode attention with all metadata on the device: the draft loop's (one query token per request)."""

from __future__ import annotations

import torch

from specserve.attention.base import AttentionBackend, AttentionMetadata, is_fp8, kernel_query, write_kv
from specserve.attention.triton_backend import GRAPH_BLOCK_M, LOG2E, next_pow2
from specserve.attention.triton_kernels import paged_attention_kernel


class TritonDecodeAttention(AttentionBackend):
    """One query token per request, with all metadata on the device: the draft loop's attention.

    ``set_step(slots, seq_lens)`` takes device tensors (computed inside a captured graph, e.g.
    from base positions + the step index), so nothing is planned on the host. Request b's token
    writes its K/V at ``slots[b]`` and attends to the first ``seq_lens[b]`` keys of row b of
    ``block_tables`` (a static [max_seqs, max_blocks] int64 buffer the caller fills). Keys are
    not split over programs: one program per (request, KV head), enough for a one-layer head.
    """

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, scale: float, *,
                 num_heads: int, block_tables: torch.Tensor, block_n: int = 64, num_warps: int = 4) -> None:
        super().__init__(kv_caches, block_size, scale)
        k0 = kv_caches[0][0]
        _, page, self.num_kv_heads, self.head_dim = k0.shape
        if page != block_size:
            raise ValueError(f"cache block size {page} != block_size {block_size}")
        self.num_heads = num_heads
        self.group = num_heads // self.num_kv_heads
        self.block_tables = block_tables
        self.block_n = block_n
        self.num_warps = num_warps
        dev = k0.device
        n = block_tables.shape[0]
        self._arange = torch.arange(n, dtype=torch.int32, device=dev)
        self._ones = torch.ones(n, dtype=torch.int32, device=dev)
        self._zeros = torch.zeros(n, dtype=torch.int32, device=dev)
        self._no_part = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self._no_bits = torch.zeros(n, dtype=torch.int64, device=dev)
        self._dummy = torch.zeros(1, dtype=torch.float32, device=dev)  # partial outputs: never written
        self._slots: torch.Tensor | None = None
        self._seq32: torch.Tensor | None = None

    def plan(self, meta: AttentionMetadata) -> None:  # pragma: no cover - the interface's host path
        raise NotImplementedError("TritonDecodeAttention takes device metadata through set_step()")

    def set_step(self, slots: torch.Tensor, seq_lens: torch.Tensor, max_kv: int | None = None) -> None:
        self._slots = slots
        self._seq32 = seq_lens.to(torch.int32)

    @property
    def supports_fused_rope(self) -> bool:  # type: ignore[override]
        return self.kv_caches[0][0].is_cuda

    def forward_rope(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_heads: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        from specserve.models.triton_ops import rope_and_cache

        assert self._slots is not None and self._seq32 is not None, "set_step() first"
        kv = self.kv_caches[layer]
        if qkv.dtype != kv[0].dtype and not is_fp8(kv[0].dtype):
            raise ValueError(f"the fused rotary kernel needs qkv in the cache's dtype {kv[0].dtype}, got {qkv.dtype}")
        q = rope_and_cache(qkv, cos, sin, kv, self._slots, num_heads, self.num_kv_heads, self.head_dim, positions)
        return self._attend(layer, q)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self._slots is not None and self._seq32 is not None, "set_step() first"
        write_kv(self.kv_caches[layer], self._slots, k, v)
        return self._attend(layer, q)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q [B, H, D] over the cache, this step's K/V already written."""
        k_cache, v_cache = self.kv_caches[layer]
        n = q.shape[0]
        q = kernel_query(q, k_cache.dtype)
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        seq, bt = self._seq32, self.block_tables
        block_d = max(16, next_pow2(self.head_dim))
        paged_attention_kernel[(n, self.num_kv_heads)](
            q, k_cache, v_cache, out, self._dummy, self._dummy,
            self._arange, self._arange, self._ones, self._zeros, seq, self._no_part, self._zeros,
            seq, seq, self._no_bits, self._zeros, self._zeros, self._zeros,  # (path, counts: EXACT variant only)
            bt, bt.stride(0), self.scale * LOG2E, 0,  # (window: read by WINDOWED launches only)
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            0, 0,
            G=self.group, BLOCK_M=max(GRAPH_BLOCK_M, next_pow2(self.group)), BLOCK_N=self.block_n,
            HEAD_DIM=self.head_dim, BLOCK_D=block_d, PAGE=self.block_size,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", EXACT=False, WINDOWED=False,
            num_warps=self.num_warps, num_stages=2,
        )
        return out
