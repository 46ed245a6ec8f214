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

from specserve.attention.base import to_cache_dtype, write_kv  # noqa: E402
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


FP8_STORES = pytest.mark.skipif(not CUDA, reason="Triton 3.6's interpreter rounds into 8-bit floats without carrying "
                                "into the exponent (7.8 -> 4.0, 1.96 -> 1.0; checked on the GPU)")


@FP8_STORES
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_rope_and_cache_into_an_fp8_cache_saturates_as_the_torch_write(cache_dtype):
    """--kv-cache-dtype fp8: the fused kernel rounds k and v into 8-bit floats as write_kv does
    (clamped at the format's largest value, where a cast would give inf or NaN)."""
    heads, kv_heads, head_dim, T, blocks, bs = 4, 2, 32, 5, 6, 4
    g = torch.Generator().manual_seed(11)
    big = torch.finfo(cache_dtype).max
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None)
    cos, sin = rope(torch.tensor([0, 7, 3, 100, 255], device=DEVICE), torch.float32)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g) * 4
    qkv[:, -3:] = torch.tensor([3 * big, -3 * big, 0.01])  # v values past the format on either side
    qkv = qkv.to(DEVICE)
    slots = torch.tensor([5, 0, 23, 12, 13], device=DEVICE)
    caches = [tuple(torch.zeros(blocks, bs, kv_heads, head_dim, dtype=torch.uint8, device=DEVICE).view(cache_dtype)
                    for _ in range(2)) for _ in range(2)]
    triton_ops.rope_and_cache(qkv, cos, sin, caches[0], slots, heads, kv_heads, head_dim)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(T, heads + kv_heads, head_dim)
    _, k_ref = apply_rotary(qk, cos, sin).split((heads, kv_heads), dim=1)
    write_kv(caches[1], slots, k_ref, qkv[:, (heads + kv_heads) * head_dim :].view(T, kv_heads, head_dim))
    v = caches[0][1].view(-1, kv_heads, head_dim)[slots].float()
    assert torch.isfinite(v).all() and (v[:, -1, -3] == big).all() and (v[:, -1, -2] == -big).all()
    assert torch.equal(caches[0][1].view(torch.uint8), caches[1][1].view(torch.uint8))  # v: the same rounding
    k, k_ref = caches[0][0].float(), caches[1][0].float()
    # k: the rotation's fp32 products may differ by an ulp, which can move a rounding by one 8-bit step
    assert (k == k_ref).float().mean() > 0.98
    mantissa_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[cache_dtype]  # (finfo.nmant: newer torch only)
    torch.testing.assert_close(k, k_ref, rtol=2.0 ** -mantissa_bits, atol=1e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_rope_and_cache_stores_8_bit_values_where_write_kv_does(cache_dtype):
    """The fused kernel's fp8 path where no rounding happens (so the interpreter checks it too): values the
    format holds exactly, at position 0 (no rotation), land bit for bit as write_kv stores them; values past
    the format's largest saturate; q is left in qkv's dtype."""
    heads, kv_heads, head_dim, T, blocks, bs = 4, 2, 32, 3, 4, 4
    g = torch.Generator().manual_seed(12)
    big = torch.finfo(cache_dtype).max
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None)
    cos, sin = rope(torch.zeros(T, dtype=torch.long, device=DEVICE), torch.float32)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(T, width, generator=g) * 8).to(cache_dtype).float()  # exactly representable
    qkv[:, -2:] = torch.tensor([5 * big, -5 * big])
    qkv[:, heads * head_dim] = 3 * big  # a key past the format too
    qkv = qkv.to(DEVICE)
    slots = torch.tensor([6, 1, 12], device=DEVICE)
    caches = [tuple(torch.zeros(blocks, bs, kv_heads, head_dim, dtype=torch.uint8, device=DEVICE).view(cache_dtype)
                    for _ in range(2)) for _ in range(2)]
    q = triton_ops.rope_and_cache(qkv, cos, sin, caches[0], slots, heads, kv_heads, head_dim)
    assert q.dtype == torch.float32 and torch.equal(q, qkv[:, : heads * head_dim].view(T, heads, head_dim))
    kv = qkv[:, heads * head_dim :].view(T, 2 * kv_heads, head_dim)
    write_kv(caches[1], slots, kv[:, :kv_heads], kv[:, kv_heads:])
    for a, b in zip(caches[0], caches[1]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    k, v = (c.view(-1, kv_heads, head_dim)[slots].float() for c in caches[0])
    assert (k[:, 0, 0] == big).all() and (v[:, -1, -2] == big).all() and (v[:, -1, -1] == -big).all()


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16,
                                         pytest.param(torch.float8_e4m3fn, marks=FP8_STORES)])
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
        caches = [(to_cache_dtype(base.clone(), cache_dtype).to(DEVICE), to_cache_dtype(base.clone(), cache_dtype).to(DEVICE))]
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
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.float8_e4m3fn: 0.07}[cache_dtype]  # (fp8: an 8-bit step)
    torch.testing.assert_close(out.float(), out_ref.float(), atol=tol, rtol=tol)
    for a, b in zip(fused.kv_caches[0], ref.kv_caches[0]):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    assert not torch.equal(fused.kv_caches[0][0].float(), to_cache_dtype(base, cache_dtype).to(DEVICE).float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 32)])
def test_draft_rope_tables_are_apply_rope_bit_for_bit(dtype, heads, kv_heads, head_dim):
    """The draft head's rotary through the kernel (fp32 tables read at each token's position, fp32
    math) equals eagle3.apply_rope + the cache write exactly; q, k and v in the right places."""
    from specserve.models.eagle3 import Eagle3Config, DraftAttention, apply_rope, rope_cos_sin

    cfg = Eagle3Config(hidden_size=heads * head_dim, intermediate_size=8, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=8, draft_vocab_size=8,
                       rope_theta=10000.0)
    att = DraftAttention(cfg, 2 * cfg.hidden_size, 0).to(DEVICE)
    att.build_rope_tables(300)
    g = torch.Generator().manual_seed(heads)
    T, blocks, bs = 6, 6, 4
    positions = torch.tensor([0, 7, 3, 100, 299, 1], device=DEVICE)
    qkv = (torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(DEVICE, dtype)
    slots = torch.tensor([5, 0, 23, 12, 13, 2], device=DEVICE)
    caches = [tuple(torch.zeros(blocks, bs, kv_heads, head_dim, device=DEVICE, dtype=dtype) for _ in range(2))
              for _ in range(2)]

    q = triton_ops.rope_and_cache(qkv, *att.rope_tables, caches[0], slots, heads, kv_heads, head_dim,
                                  positions=positions)

    qk = apply_rope(qkv[:, : (heads + kv_heads) * head_dim].view(T, heads + kv_heads, head_dim),
                    rope_cos_sin(positions, att.inv_freq))
    q_ref, k_ref = qk.split((heads, kv_heads), dim=1)
    write_kv(caches[1], slots, k_ref, qkv[:, (heads + kv_heads) * head_dim :].view(T, kv_heads, head_dim))
    assert torch.equal(q, q_ref)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    # each token at its own position: the tables read at another row give another rotation
    q_shift = triton_ops.rope_and_cache(qkv, *att.rope_tables, caches[0], slots, heads, kv_heads, head_dim,
                                        positions=positions + 1)
    assert not torch.equal(q_shift, q_ref)
    with pytest.raises(ValueError, match="tables"):
        triton_ops.rope_and_cache(qkv, att.rope_tables[0].to(dtype=torch.float64), att.rope_tables[1], caches[0],
                                  slots, heads, kv_heads, head_dim, positions=positions)


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")  # interpreter
def test_decode_attention_forward_rope_matches_rotary_then_forward():
    """TritonDecodeAttention.forward_rope (the draft loop's: rotary + KV write in one kernel, then
    attention) equals apply_rope, its plain forward, and the cache it leaves."""
    from specserve.attention.triton_decode import TritonDecodeAttention
    from specserve.models.eagle3 import Eagle3Config, DraftAttention, apply_rope, rope_cos_sin

    H, KVH, D, bs, nb = 4, 2, 32, 4, 16
    cfg = Eagle3Config(hidden_size=H * D, intermediate_size=8, num_attention_heads=H, num_key_value_heads=KVH,
                       head_dim=D, vocab_size=8, draft_vocab_size=8)
    att = DraftAttention(cfg, 2 * cfg.hidden_size, 0).to(DEVICE)
    att.build_rope_tables(64)
    g = torch.Generator().manual_seed(5)
    base = torch.randn(nb, bs, KVH, D, generator=g)
    tables = torch.tensor([[3, 7, 0], [1, 9, 2]], device=DEVICE)
    positions = torch.tensor([6, 9], device=DEVICE)
    slots = torch.tensor([7 * bs + 2, 2 * bs + 1], device=DEVICE)
    qkv = torch.randn(2, (H + 2 * KVH) * D, generator=g).to(DEVICE)

    def backend():
        b = TritonDecodeAttention([(base.clone().to(DEVICE), base.clone().to(DEVICE))], bs, D**-0.5,
                                  num_heads=H, block_tables=tables)
        b.set_step(slots, (positions + 1).to(torch.int32))
        return b

    fused, ref = backend(), backend()
    out = fused.forward_rope(0, qkv, *att.rope_tables, H, positions=positions)
    qk = apply_rope(qkv[:, : (H + KVH) * D].view(2, H + KVH, D), rope_cos_sin(positions, att.inv_freq))
    q, k = qk.split((H, KVH), dim=1)
    out_ref = ref.forward(0, q, k, qkv[:, (H + KVH) * D :].view(2, KVH, D))
    assert torch.equal(out, out_ref)
    for a, b in zip(fused.kv_caches[0], ref.kv_caches[0]):
        assert torch.equal(a, b)
    assert not torch.equal(fused.kv_caches[0][0], base.to(DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the head takes the fused kernels on CUDA tensors only")
def test_fused_head_step_takes_one_rotary_kernel_and_matches_the_torch_ops(monkeypatch):
    """A bf16 draft step of a fused head with rope tables over TritonDecodeAttention: the rotary and
    KV write go through rope_and_cache (apply_rope is not called), and the hidden output and the
    cache match the torch ops' (layers.FUSED_OPS off) up to bf16 rounding."""
    from specserve.attention.base import forward_context
    from specserve.attention.triton_decode import TritonDecodeAttention
    from specserve.models import eagle3, layers

    H, KVH, D, bs, nb = 4, 2, 32, 4, 16
    cfg = eagle3.Eagle3Config(hidden_size=H * D, intermediate_size=96, num_attention_heads=H, num_key_value_heads=KVH,
                              head_dim=D, vocab_size=64, draft_vocab_size=64)
    torch.manual_seed(0)
    head = eagle3.Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    head = head.to(DEVICE, torch.bfloat16).eval().fuse_projections()
    head.build_rope_tables(64)
    base = torch.randn(nb, bs, KVH, D).to(DEVICE, torch.bfloat16)
    tables = torch.tensor([[3, 7, 0], [1, 9, 2]], device=DEVICE)
    positions = torch.tensor([6, 9], device=DEVICE)
    slots = torch.tensor([7 * bs + 2, 2 * bs + 1], device=DEVICE)
    e, h = torch.randn(2, H * D).to(DEVICE, torch.bfloat16), torch.randn(2, H * D).to(DEVICE, torch.bfloat16)
    calls = []
    real = eagle3.apply_rope
    monkeypatch.setattr(eagle3, "apply_rope", lambda *a: calls.append(1) or real(*a))

    def step(fused_ops: bool):
        monkeypatch.setattr(layers, "FUSED_OPS", fused_ops)
        attn = TritonDecodeAttention([(base.clone(), base.clone())], bs, D**-0.5, num_heads=H, block_tables=tables)
        attn.set_step(slots, (positions + 1).to(torch.int32))
        with torch.inference_mode(), forward_context(attn):
            return head(e, h, positions), attn.kv_caches[0]

    out, cache = step(True)
    assert not calls
    out_ref, cache_ref = step(False)
    assert calls
    torch.testing.assert_close(out.float(), out_ref.float(), atol=3e-2, rtol=2e-2)
    for a, b in zip(cache, cache_ref):  # (the norms before qkv are fused kernels too: bf16 rounding)
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=2e-2)
    assert not torch.equal(cache[0], base)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 8192, 4), (16, 8192, 4), (3, 1000, 8), (2, 64, 1)])
def test_topk_logprobs_matches_log_softmax_then_topk(dtype, rows, n, k):
    g = torch.Generator().manual_seed(rows * n + k)
    logits = (torch.randn(rows, n, generator=g) * 4).to(DEVICE, dtype)
    val, idx = triton_ops.topk_logprobs(logits, k)
    ref_val, ref_idx = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    torch.testing.assert_close(val, ref_val, atol=1e-5, rtol=1e-5)
    # bf16 logits tie often: then each index must still hold its value
    if dtype == torch.float32:
        assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(torch.log_softmax(logits.float(), -1).gather(1, idx), val, atol=1e-5, rtol=1e-5)
    assert (val[:, :-1] >= val[:, 1:]).all()


def test_topk_logprobs_takes_the_lower_index_among_ties_and_refuses_wide_rows():
    logits = torch.zeros(2, 32, device=DEVICE)
    logits[0, [5, 9, 20]] = 1.0
    val, idx = triton_ops.topk_logprobs(logits, 4)
    assert idx[0].tolist() == [5, 9, 20, 0] and idx[1].tolist() == [0, 1, 2, 3]
    assert torch.allclose(val[1], torch.full((4,), -torch.log(torch.tensor(32.0)).item(), device=DEVICE))
    with pytest.raises(ValueError, match="at most"):
        triton_ops.topk_logprobs(torch.zeros(1, triton_ops.TOPK_LOGPROBS_MAX_N + 1, device=DEVICE), 2)
