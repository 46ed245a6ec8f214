"""Draft trees on the device (select_trees, accept_trees) are the reference selection and the host's acceptance."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch

from specserve.speculative.accept import accept_chains_on_device, accept_greedy, accept_trees
from specserve.speculative.tree import DraftTree, select_trees, tree_fields, tree_width
from specserve.speculative.tree_graph import candidate_depths


class Candidate(NamedTuple):
    token: int
    score: float  # cumulative draft log-probability
    parent: int  # candidate index of the parent, -1 for a child of the root
    depth: int


def select_tree(root_token: int, cands: list[Candidate], num_nodes: int) -> DraftTree:
    """The reference, written out: the best ``num_nodes`` candidates (ties: shallower first, then earlier),
    closed under parents, as a tree in depth order."""
    order = sorted(range(len(cands)), key=lambda i: (-cands[i].score, cands[i].depth, i))[:num_nodes]
    chosen = set(order)
    for i in order:
        p = cands[i].parent
        while p != -1 and p not in chosen:
            chosen.add(p)
            p = cands[p].parent
    nodes = sorted(chosen, key=lambda i: (cands[i].depth, -cands[i].score, i))
    index = {c: k + 1 for k, c in enumerate(nodes)}
    return DraftTree([root_token] + [cands[c].token for c in nodes],
                     [-1] + [0 if cands[c].parent == -1 else index[cands[c].parent] for c in nodes],
                     [0] + [cands[c].depth for c in nodes])


def bits_to_mask(bits: torch.Tensor) -> torch.Tensor:
    """Ancestor bits [..., n] -> the attention mask bool [..., n, n] (row i, column j: bit j of row i)."""
    n = bits.shape[-1]
    return ((bits[..., :, None] >> torch.arange(n, device=bits.device)) & 1).bool()


def expansion(rng: random.Random, topk: int, depth: int, vocab: int, ties: bool) -> list[Candidate]:
    """Candidates as the expansion writes them: topk children of the root, then per depth topk^2
    children of that depth's frontier (the topk best so far), scores cumulative log-probabilities."""
    cands = []
    for t in rng.sample(range(vocab), topk):  # a top-k: distinct tokens
        lp = -rng.choice([0.0, 0.5, 1.0]) if ties else -rng.random() * 3
        cands.append(Candidate(t, lp, -1, 1))
    front = list(range(topk))
    for d in range(2, depth + 1):
        first = len(cands)
        for f in front:
            toks = rng.sample(range(vocab), topk)  # siblings differ
            for t in toks:
                lp = -rng.choice([0.0, 0.5, 1.0]) if ties else -rng.random() * 3
                cands.append(Candidate(t, cands[f].score + lp, f, d))
        new = list(range(first, len(cands)))
        new.sort(key=lambda i: -cands[i].score)  # (stable: ties by index, as topk on the device may not)
        front = new[:topk]
    return cands


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_select_trees_is_select_tree(device):
    rng = random.Random(0)
    for topk, depth, n in [(3, 4, 9), (4, 5, 16), (2, 3, 4), (4, 2, 20), (1, 5, 6)]:
        for ties in (False, True):
            B = 6
            batch = [expansion(rng, topk, depth, 50, ties) for _ in range(B)]
            tok = torch.tensor([[c.token for c in cs] for cs in batch])
            score = torch.tensor([[c.score for c in cs] for cs in batch], dtype=torch.float32)
            par = torch.tensor([[c.parent for c in cs] for cs in batch])
            dep = torch.tensor(candidate_depths(topk, depth))
            assert dep.tolist() == [c.depth for c in batch[0]]
            out = torch.zeros(B, tree_width(n), dtype=torch.long, device=device)
            select_trees(tok.to(device), score.to(device), par.to(device), dep.to(device), n, depth, out)
            t, p, d, bits = tree_fields(out.cpu(), n)
            m = bits_to_mask(bits)
            for b, cs in enumerate(batch):
                # (scores as the device holds them: fp32)
                cs32 = [Candidate(c.token, float(torch.tensor(c.score, dtype=torch.float32)), c.parent, c.depth)
                        for c in cs]
                ref = select_tree(7, cs32, n - 1)
                assert t[b, 1:].tolist() == ref.tokens[1:]
                assert [-1] + p[b, 1:].tolist() == ref.parents and p[b, 0] == 0
                assert d[b].tolist() == ref.depths
                assert torch.equal(m[b].bool(), ref.mask())


@pytest.mark.parametrize("device", DEVICES)
def test_accept_trees_is_accept_greedy(device):
    rng = random.Random(1)
    topk, depth, n, V = 3, 4, 10, 6  # a small vocabulary: many picks match, paths of every length
    lengths = set()
    for _ in range(40):
        B = 5
        batch = [expansion(rng, topk, depth, V, False) for _ in range(B)]
        out = torch.zeros(B, tree_width(n), dtype=torch.long)
        select_trees(torch.tensor([[c.token for c in cs] for cs in batch]),
                     torch.tensor([[c.score for c in cs] for cs in batch], dtype=torch.float32),
                     torch.tensor([[c.parent for c in cs] for cs in batch]),
                     torch.tensor(candidate_depths(topk, depth)), n, depth, out)
        t, p, d, _ = tree_fields(out, n)
        trees = [DraftTree(t[b].tolist(), [-1] + p[b, 1:].tolist(), d[b].tolist()) for b in range(B)]
        picks = torch.randint(0, V, (B, n))
        for b in range(B):  # picks that follow the tree some way down
            node = 0
            for _ in range(rng.randrange(depth + 1)):
                kids = trees[b].children(node)
                if not kids:
                    break
                node = rng.choice(kids)
                picks[b, trees[b].parents[node]] = trees[b].tokens[node]
        accepted, path, bonus = (x.cpu() for x in accept_trees(t.to(device), p.to(device), d.to(device),
                                                               picks.to(device), depth))
        for b in range(B):
            ref = accept_greedy(trees[b], picks[b].tolist())
            a = int(accepted[b])
            lengths.add(a)
            assert a == ref.num_accepted
            assert path[b, 1 : a + 1].tolist() == ref.path and path[b, 0] == 0
            assert int(bonus[b]) == ref.tokens[-1]
    assert lengths >= {0, 1, 2, 3}


@pytest.mark.parametrize("device", DEVICES)
def test_select_trees_smaller_sizes_are_their_own_best(device):
    """A request drafting fewer nodes gets the best that many (the host's select_tree at its size),
    not a cut of the larger tree, in its first nodes."""
    rng = random.Random(2)
    topk, depth, n = 4, 5, 16
    batch = [expansion(rng, topk, depth, 50, False) for _ in range(4)]
    sizes = [15, 3, 7, 1]
    out = torch.zeros(4, tree_width(n), dtype=torch.long, device=device)
    select_trees(torch.tensor([[c.token for c in cs] for cs in batch], device=device),
                 torch.tensor([[c.score for c in cs] for cs in batch], dtype=torch.float32, device=device),
                 torch.tensor([[c.parent for c in cs] for cs in batch], device=device),
                 torch.tensor(candidate_depths(topk, depth), device=device), n, depth, out,
                 torch.tensor(sizes, device=device))
    t, p, d, bits = tree_fields(out.cpu(), n)
    m = bits_to_mask(bits)
    cut = 0
    for b, (cs, k) in enumerate(zip(batch, sizes)):
        cs32 = [Candidate(c.token, float(torch.tensor(c.score, dtype=torch.float32)), c.parent, c.depth) for c in cs]
        ref = select_tree(0, cs32, k)
        assert t[b, 1 : k + 1].tolist() == ref.tokens[1:]
        assert [-1] + p[b, 1 : k + 1].tolist() == ref.parents and d[b, : k + 1].tolist() == ref.depths
        assert torch.equal(m[b, : k + 1, : k + 1].bool(), ref.mask())
        cut += select_tree(0, cs32, n - 1).truncated(k).tokens != ref.tokens
    assert cut > 0  # (a cut of the larger tree would differ somewhere)


def test_chains_accepted_on_the_device_are_the_hosts():
    """accept_chains_on_device (the fused launch's, eager and graphed) = accept_greedy on each chain."""
    rng = random.Random(0)
    for _ in range(50):
        ks = [rng.randint(0, 4) for _ in range(rng.randint(1, 5))]
        K, B = max(max(ks), 1), len(ks)
        ids, picks, drafts = [], [], []
        for k in ks:
            d = [rng.randint(0, 3) for _ in range(k)]
            drafts.append(d)
            ids += [9] + d  # the last committed token, then the drafts
            picks += [rng.randint(0, 3) for _ in range(k + 1)]
        first = [sum(k + 1 for k in ks[:b]) for b in range(B)]
        T = len(ids)
        req = [b for b, k in enumerate(ks) for _ in range(k + 1)]
        j = [i - first[b] for i, b in enumerate(req)]
        nxt = [min(i + 1, first[b] + ks[b]) for i, b in enumerate(req)]
        drow = [min(first[b] + i, T - 1) for b in range(B) for i in range(K)]
        valid = [int(i < ks[b]) for b in range(B) for i in range(K)]
        t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        acc, row_ids = accept_chains_on_device(t(ids), t(picks), t(nxt), t(j), t(req), t(drow), t(valid), t(first))
        for b, d in enumerate(drafts):
            want = accept_greedy(DraftTree.chain(9, d), picks[first[b] : first[b] + ks[b] + 1])
            assert acc[b].item() == want.num_accepted
            a = want.num_accepted  # rows 0..a of the catch-up pair their feature with the token after them
            assert row_ids[first[b] : first[b] + a + 1].tolist() == want.tokens
