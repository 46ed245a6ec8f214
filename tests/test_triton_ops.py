"""The fused Triton elementwise kernels (models/triton_ops.py) against the torch ops they replace.

Without CUDA they run in Triton's interpreter, so the same kernel source is checked here and on
the GPU (where bf16 is compared too). Skipped when triton is not installed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import triton_tests_device  # noqa: E402

DEVICE = triton_tests_device()
CUDA = DEVICE.type == "cuda"

from specserve.attention.base import write_kv  # noqa: E402
from specserve.models import triton_ops  # noqa: E402
from specserve.models.layers import RotaryEmbedding, apply_rotary  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32: only the norm's summation order differs; bf16: that can move a rounding by one step
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (5, 576), (3, 96), (2, 4096)])
def test_add_rms_norm_matches_torch(dtype, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g).to(DEVICE, dtype) * 3
    r = torch.randn(rows, n, generator=g).to(DEVICE, dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(DEVICE, dtype)
    out, s = triton_ops.add_rms_norm(x, r, w, 1e-5)
    ref_s = x + r
    assert torch.equal(s, ref_s)  # the new residual stream: one rounded add, exactly torch's
    _close(out, w * F.rms_norm(ref_s, (n,), None, 1e-5), dtype)
    out_plain, same = triton_ops.add_rms_norm(x, None, w, 1e-5)
    assert same is x
    _close(out_plain, w * F.rms_norm(x, (n,), None, 1e-5), dtype)
    # a wrong eps or a missing weight would show
    assert not torch.allclose(out_plain.float(), F.rms_norm(x, (n,), None, 1e-5).float(), atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(1)
    for rows, inter in [(1, 1536), (4, 100), (3, 2048)]:
        gu = torch.randn(rows, 2 * inter, generator=g).to(DEVICE, dtype) * 4
        gate, up = gu.chunk(2, dim=-1)
        _close(triton_ops.silu_mul(gu), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (4, 2, 32)])
def test_rope_and_cache_matches_rotary_then_write(dtype, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(heads)
    T, blocks, bs = 5, 6, 4
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None)
    positions = torch.tensor([0, 7, 3, 100, 255], device=DEVICE)
    cos, sin = rope(positions, dtype)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    slots = torch.tensor([5, 0, 23, 12, 13], device=DEVICE)
    caches = [tuple(torch.zeros(blocks, bs, kv_heads, head_dim, device=DEVICE, dtype=dtype) for _ in range(2))
              for _ in range(2)]

    q = triton_ops.rope_and_cache(qkv, cos, sin, caches[0], slots, heads, kv_heads, head_dim)

    qk = qkv[:, : (heads + kv_heads) * head_dim].view(T, heads + kv_heads, head_dim)
    q_ref, k_ref = apply_rotary(qk, cos, sin).split((heads, kv_heads), dim=1)
    v_ref = qkv[:, (heads + kv_heads) * head_dim :].view(T, kv_heads, head_dim)
    write_kv(caches[1], slots, k_ref, v_ref)
    _close(q, q_ref, dtype)
    _close(caches[0][0], caches[1][0], dtype)
    assert torch.equal(caches[0][1], caches[1][1])  # v is copied, not rotated
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert caches[0][0].view(-1, kv_heads, head_dim)[untouched.to(DEVICE)].abs().sum() == 0


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_backend_forward_rope_matches_rotary_then_forward(cache_dtype):
    """TritonBackend.forward_rope (the fused kernel, or rotary + forward where qkv is not in the
    cache dtype) against rotary by the torch ops and the backend's plain forward."""
    from specserve.attention.base import AttentionMetadata
    from specserve.attention.triton_backend import TritonBackend

    H, KVH, D, bs, nb = 4, 2, 32, 4, 16
    g = torch.Generator().manual_seed(3)
    q_lens, ctx = [1, 3], [5, 2]
    seq = [c + q for c, q in zip(ctx, q_lens)]
    tables = [[3, 7], [1, 9]]
    slots = [t[p // bs] * bs + p % bs for t, s, q in zip(tables, seq, q_lens) for p in range(s - q, s)]
    meta = AttentionMetadata(query_lens=q_lens, seq_lens=seq, slot_mapping=torch.tensor(slots, device=DEVICE),
                             block_tables=torch.tensor(tables, device=DEVICE))
    base = torch.randn(nb, bs, KVH, D, generator=g)
    positions = torch.tensor([5, 2, 3, 4], device=DEVICE)
    rope = RotaryEmbedding(D, 64, 10000.0, None)
    qkv = torch.randn(4, (H + 2 * KVH) * D, generator=g).to(DEVICE)

    def backend():
        caches = [(base.clone().to(DEVICE, cache_dtype), base.clone().to(DEVICE, cache_dtype))]
        b = TritonBackend(caches, bs, D**-0.5, num_heads=H, max_num_tokens=8, max_num_seqs=4, max_blocks_per_seq=4)
        b.plan(meta)
        return b

    fused = backend()
    cos, sin = rope(positions, torch.float32)
    out = fused.forward_rope(0, qkv, cos, sin, H)
    ref = backend()
    qk = apply_rotary(qkv[:, : (H + KVH) * D].view(4, H + KVH, D), cos, sin)
    q, k = qk.split((H, KVH), dim=1)
    out_ref = ref.forward(0, q, k, qkv[:, (H + KVH) * D :].view(4, KVH, D))
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), out_ref.float(), atol=tol, rtol=tol)
    for a, b in zip(fused.kv_caches[0], ref.kv_caches[0]):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    assert not torch.equal(fused.kv_caches[0][0], base.to(DEVICE, cache_dtype))  # this step's K was written
