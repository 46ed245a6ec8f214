"""Attention-backend interface and the per-step forward context.

A step is one flat, ragged batch: request b contributes ``query_lens[b]`` tokens whose K/V are
written at ``slot_mapping`` and which attend to the first ``seq_lens[b]`` cached tokens of the
request (their own included). Tokens of a speculative tree attend among themselves through
``tree_masks[b]`` instead of the causal rule.

The backend is planned once per step (``plan``) and then run once per layer (``forward``).
Model code never sees the metadata: it calls ``get_forward_context().attn.forward(...)``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # host copy: tokens per request this step
    seq_lens: list[int]  # host copy: cached tokens per request after this step's writes
    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token (block * block_size + offset)
    block_tables: torch.Tensor  # [B, max_blocks] int64 block ids per request
    # b -> bool [q_b, q_b] (row attends column), or int64 [q_b]: each row packed as bits (bit j: column j)
    tree_masks: dict[int, torch.Tensor] | None = None
    # [B] int on the device, <= 0: what each request's seq_len really is minus ``seq_lens[b]``, for a
    # step launched before the host knows its lengths (the drafter's verify launched before a sync:
    # planned at the longest, its positions and slots written on the device). Every token's key limits
    # move by it; no key at or past the real length is read
    seq_shift: torch.Tensor | None = None
    # engines with a pool of their own for sliding-window layers (kv_cache.WindowBlocks): what those
    # layers write and read instead of slot_mapping / block_tables (same shapes; null entries masked)
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))


class AttentionBackend(ABC):
    """Owns the KV cache tensors of one model and computes paged attention."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, scale: float) -> None:
        # each cache: [num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scale = scale

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare per-step indices and masks shared by every layer."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (this step's tokens, RoPE applied) -> out [T, H, D].

        Writes k/v into the cache first, so a token attends to itself. ``window`` (sliding-window
        layers): a token at KV position p sees only keys at positions > p - window; where the step has
        window tables, the layer's cache is in the window pool and read through them.
        """

    # backends that take the fused qkv projection and do rotary + the cache write in one kernel
    supports_fused_rope = False

    def step_slots(self, num_tokens: int) -> torch.Tensor:
        """The KV cache slots of the planned step's first ``num_tokens`` rows, on the device (a graph
        replay's padding rows: the scratch slot), for writes that follow the KV (EAGLE-3 features)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its step's slots")

    def forward_rope(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_heads: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` from qkv [T, (H + 2 KVH) * D] before rotary: cos/sin of RotaryEmbedding, or
        with ``positions`` the draft head's fp32 tables [P, D] (triton_ops.rope_and_cache)."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse rotary into the cache write")


@dataclass
class ForwardContext:
    attn: AttentionBackend


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: run the model inside specserve.attention.forward_context()")
    return _CONTEXT


@contextlib.contextmanager
def forward_context(attn: AttentionBackend) -> Iterator[ForwardContext]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ForwardContext(attn=attn)
    try:
        yield _CONTEXT
    finally:
        _CONTEXT = prev


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # what --kv-cache-dtype fp8 / fp8_e5m2 store


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def kernel_query(q: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """q as the Triton kernels read it: the cache's dtype (8-bit caches: q's own), unit last stride."""
    if q.dtype != cache_dtype and not is_fp8(cache_dtype):
        q = q.to(cache_dtype)
    return q if q.stride(-1) == 1 else q.contiguous()


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: 8-bit floats saturate at the format's largest value, explicitly (a
    cast's overflow is inf for e5m2 and, where not saturating, NaN for e4m3)."""
    if x.dtype == dtype:
        return x
    if is_fp8(dtype):
        big = torch.finfo(dtype).max
        return x.clamp(-big, big).to(dtype)
    return x.to(dtype)


def gather_kv(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``flat[slots]`` ([*slots.shape, KVH, D]) through index_select: on the CPU ~5x faster than indexing."""
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *flat.shape[1:])


def write_kv(kv_cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store this step's k, v [T, KVH, D] at their flat cache slots; returns both caches viewed
    flat as [num_slots, KVH, D]."""
    k_cache, v_cache = kv_cache
    kvh, d = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, kvh, d)
    v_flat = v_cache.view(-1, kvh, d)
    k_new, v_new = to_cache_dtype(k, k_flat.dtype), to_cache_dtype(v, v_flat.dtype)
    if is_fp8(k_flat.dtype):  # moved as bytes (the CPU's index_copy_ has no fp8 kernel)
        k_flat.view(torch.uint8).index_copy_(0, slots, k_new.view(torch.uint8))
        v_flat.view(torch.uint8).index_copy_(0, slots, v_new.view(torch.uint8))
    else:
        k_flat.index_copy_(0, slots, k_new)
        v_flat.index_copy_(0, slots, v_new)
    return k_flat, v_flat
