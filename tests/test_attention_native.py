"""The torch-native backend (CPU default) against attention written out per request, and its
grouping: requests with long queries (prompts) are padded apart from short ones (decodes)."""

from __future__ import annotations

import pytest
import torch

from specserve.attention.base import AttentionMetadata
from specserve.attention.torch_native import TorchNativeBackend

TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


def _step(q_lens, ctx_lens, trees=None, heads=4, kv_heads=2, d=16, bs=4, nb=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = [c + q for c, q in zip(ctx_lens, q_lens)]
    perm = torch.randperm(nb, generator=g).tolist()
    tables, off = [], 0
    for s in seq:
        n = -(-s // bs)
        tables.append(perm[off : off + n])
        off += n
    width = max(len(t) for t in tables)
    slots = [t[p // bs] * bs + p % bs for t, s, q in zip(tables, seq, q_lens) for p in range(s - q, s)]
    shape = (nb, bs, kv_heads, d)
    cache = (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    T = sum(q_lens)
    q, k, v = (torch.randn(T, n, d, generator=g) for n in (heads, kv_heads, kv_heads))
    meta = AttentionMetadata(list(q_lens), seq, torch.tensor(slots), torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             trees)
    return cache, q, k, v, meta, tables


def _run(short_q, cache, q, k, v, meta):
    be = TorchNativeBackend([(cache[0].clone(), cache[1].clone())], cache[0].shape[1], q.shape[-1] ** -0.5)
    be.short_q = short_q
    be.plan(meta)
    return be.forward(0, q, k, v), be


def _by_hand(cache, q, k, v, meta, tables):
    """Each request alone: write its K/V, gather its keys, softmax over the allowed ones."""
    kc, vc = cache[0].clone(), cache[1].clone()
    bs, kvh, d = kc.shape[1:]
    kc.view(-1, kvh, d)[meta.slot_mapping] = k
    vc.view(-1, kvh, d)[meta.slot_mapping] = v
    out, a = [], 0
    rep = q.shape[1] // kvh
    for b, (ql, sl) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        slots = torch.tensor([tables[b][p // bs] * bs + p % bs for p in range(sl)])
        K = kc.view(-1, kvh, d)[slots].repeat_interleave(rep, 1)  # [S, H, D]
        V = vc.view(-1, kvh, d)[slots].repeat_interleave(rep, 1)
        Q = q[a : a + ql]
        allowed = torch.arange(sl)[None, :] <= (sl - ql + torch.arange(ql))[:, None]
        tm = (meta.tree_masks or {}).get(b)
        if tm is not None:
            allowed[:, sl - ql :] = tm
        s = torch.einsum("qhd,shd->hqs", Q, K) * d**-0.5
        s = s.masked_fill(~allowed[None], float("-inf"))
        out.append(torch.einsum("hqs,shd->qhd", s.softmax(-1), V))
        a += ql
    return torch.cat(out)


@pytest.mark.parametrize("short_q", [1, 3, 32])
def test_grouped_padding_matches_attention_by_hand(short_q):
    # a prompt of 20, decodes, a tree verify of 4 and a chain verify of 3 in one step
    cache, q, k, v, meta, tables = _step([1, 20, 4, 1, 3, 9], [17, 0, 6, 40, 11, 5], trees={2: TREE})
    out, be = _run(short_q, cache, q, k, v, meta)
    want = _by_hand(cache, q, k, v, meta, tables)
    assert torch.allclose(out, want, atol=1e-5), (out - want).abs().max()
    # short_q 1: decodes together, each longer request alone; 32: everything in one group
    assert len(be._groups) == {1: 5, 3: 4, 32: 1}[short_q]
    assert max(g.shape[1] for g in be._groups) == 20


def test_decodes_are_not_padded_to_a_prompt():
    cache, q, k, v, meta, _ = _step([1] * 6 + [40], [30] * 6 + [0])
    _, be = _run(TorchNativeBackend.short_q, cache, q, k, v, meta)
    assert sorted(g.shape for g in be._groups) == [(1, 40, 40), (6, 1, 31)]


def test_tree_rows_packed_as_bits_are_the_mask():
    """A tree handed over as each row's bits (the drafter's device trees) attends as its bool mask does."""
    cache, q, k, v, meta, tables = _step([1, 4, 3], [17, 6, 11], trees={1: TREE})
    out, _ = _run(TorchNativeBackend.short_q, cache, q, k, v, meta)
    bits = (TREE.long() << torch.arange(TREE.shape[1])).sum(-1)
    cache2, q2, k2, v2, meta2, _ = _step([1, 4, 3], [17, 6, 11], trees={1: bits})
    out2, _ = _run(TorchNativeBackend.short_q, cache2, q2, k2, v2, meta2)
    assert torch.equal(out, out2)
    assert torch.allclose(out, _by_hand(cache, q, k, v, meta, tables), atol=1e-5)
