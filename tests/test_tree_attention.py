"""The draft head's tree attention against attention written out per query.

A query of tree depth d attends to its request's committed draft KV (paged), to its ancestors'
K/V from the earlier depths, and to itself; never to its siblings or to other branches."""

from __future__ import annotations

import torch

from specserve.attention.tree_draft import TreeDraftBackend

BS, KVH, H, D = 4, 2, 4, 8


def _reference(q, keys, vals, scale):
    """q [H, D]; keys/vals [S, KVH, D] -> [H, D] (grouped-query attention)."""
    k = keys.repeat_interleave(H // KVH, dim=1)  # [S, H, D]
    v = vals.repeat_interleave(H // KVH, dim=1)
    w = torch.softmax(torch.einsum("hd,shd->hs", q, k) * scale, dim=-1)
    return torch.einsum("hs,shd->hd", w, v)


def test_tree_queries_attend_to_prefix_ancestors_and_themselves() -> None:
    torch.manual_seed(0)
    num_blocks, layers, K = 12, 2, 3
    caches = [(torch.randn(num_blocks, BS, KVH, D), torch.randn(num_blocks, BS, KVH, D)) for _ in range(layers)]
    scale = D ** -0.5
    be = TreeDraftBackend(caches, BS, scale)
    tables = [[3, 7, 1], [5, 2]]
    prefix = [10, 6]  # committed draft positions per request
    B = len(tables)

    def prefix_kv(layer: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = caches[layer]
        slots = [(tables[b][j // BS], j % BS) for j in range(prefix[b])]
        return (torch.stack([kc[blk, off] for blk, off in slots]), torch.stack([vc[blk, off] for blk, off in slots]))

    be.begin(tables, prefix, K)
    # node (b, depth, i): its K/V, and its parent's index among the previous depth's K queries
    node_k: dict[tuple[int, int, int], torch.Tensor] = {}
    node_v: dict[tuple[int, int, int], torch.Tensor] = {}
    parent: dict[tuple[int, int, int], int] = {}
    anc = None
    for depth in range(10):  # past the buffers' first capacity (8 depths): they grow
        if depth > 0:
            par = torch.randint(0, K, (B, K))  # each new query hangs under one of the last depth's
            for b in range(B):
                for i in range(K):
                    parent[(b, depth, i)] = int(par[b, i])
            onehot = torch.nn.functional.one_hot(par, K).bool()
            anc = onehot if anc is None else torch.cat(
                [anc.gather(1, par[:, :, None].expand(-1, -1, anc.shape[2])), onehot], 2)
        be.set_ancestors(anc)
        for layer in range(layers):
            q = torch.randn(B * K, H, D)
            k = torch.randn(B * K, KVH, D)
            v = torch.randn(B * K, KVH, D)
            out = be.forward(layer, q, k, v)
            for b in range(B):
                for i in range(K):
                    node_k[(layer, b, depth, i)] = k[b * K + i]
                    node_v[(layer, b, depth, i)] = v[b * K + i]
            for b in range(B):
                pk, pv = prefix_kv(layer, b)
                for i in range(K):
                    path, d, j = [], depth, i  # this query, then its ancestors up to depth 0
                    while True:
                        path.append((layer, b, d, j))
                        if d == 0:
                            break
                        j, d = parent[(b, d, j)], d - 1
                    keys = torch.cat([pk, torch.stack([node_k[n] for n in reversed(path)])])
                    vals = torch.cat([pv, torch.stack([node_v[n] for n in reversed(path)])])
                    want = _reference(q[b * K + i], keys, vals, scale)
                    torch.testing.assert_close(out[b * K + i], want, atol=1e-5, rtol=1e-5)
