"""EAGLE-2 tree construction and verification on hand-made tables."""

import math

import torch

from specserve.speculative.accept import accept_greedy, accept_tree_sampled
from specserve.speculative.tree import Candidate, DraftTree, select_tree, tree_is_final


def lg(p):
    return math.log(p)


def _cands():
    # root children: a (0.6), b (0.3); a's children: c (0.5 -> 0.30), d (0.4 -> 0.24); b's child: e (0.9 -> 0.27)
    return [
        Candidate(10, lg(0.6), -1, 1),  # 0: a
        Candidate(11, lg(0.3), -1, 1),  # 1: b
        Candidate(12, lg(0.6 * 0.5), 0, 2),  # 2: c
        Candidate(13, lg(0.6 * 0.4), 0, 2),  # 3: d
        Candidate(14, lg(0.3 * 0.9), 1, 2),  # 4: e
        Candidate(15, lg(0.3 * 0.05), 1, 2),  # 5: f
    ]


def test_select_keeps_best_by_cumulative_prob_and_orders_by_depth():
    t = select_tree(7, _cands(), 4)
    # best 4 by cumulative probability: a .6, b .3, c .3, e .27 (d .24 and f .015 dropped)
    assert t.tokens == [7, 10, 11, 12, 14]
    assert t.parents == [-1, 0, 0, 1, 2]
    assert t.depths == [0, 1, 1, 2, 2]
    assert t.children(0) == [1, 2] and t.children(1) == [3] and t.children(2) == [4]


def test_mask_is_ancestor_or_self():
    t = select_tree(7, _cands(), 4)
    m = t.mask()
    assert m.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, False, True, False, False],
        [True, True, False, True, False],
        [True, False, True, False, True],
    ]
    # any prefix of the node list is still a tree
    assert t.truncated(2).tokens == [7, 10, 11] and t.truncated(2).mask().shape == (3, 3)


def test_greedy_verify_walks_matching_children():
    t = select_tree(7, _cands(), 4)  # nodes: 1=a(10) 2=b(11) 3=c(12, under a) 4=e(14, under b)
    # target: after root -> 11 (b), after b -> 14 (e), after e -> 99
    argmax = [11, 0, 14, 0, 99]
    r = accept_greedy(t, argmax)
    assert r.path == [2, 4] and r.tokens == [11, 14, 99] and r.num_accepted == 2
    r = accept_greedy(t, [42, 0, 0, 0, 0])
    assert r.path == [] and r.tokens == [42]


def test_sampled_verify_matches_target_distribution():
    # root has children tokens 0 and 1; the target's distribution at the root is [0.5, 0.2, 0.3]
    t = DraftTree(tokens=[9, 0, 1], parents=[-1, 0, 0], depths=[0, 1, 1])
    probs = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
    g = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(3)
    for _ in range(n):
        first[accept_tree_sampled(t, probs, g).tokens[0]] += 1
    assert torch.allclose(first / n, probs[0], atol=0.015)


def _expand(rng: torch.Generator, K: int, depths: int, vocab: int = 6) -> list[list[Candidate]]:
    """EAGLE-2 expansion with random draft distributions: the candidates after each depth."""
    def children(parent_score: float) -> tuple[torch.Tensor, torch.Tensor]:
        temp = 0.3 + 3 * float(torch.rand((), generator=rng))  # confident and unsure steps alike
        lp = torch.log_softmax(torch.randn(vocab, generator=rng) * temp, -1)
        sc, tok = lp.topk(K)
        return parent_score + sc, tok

    sc, tok = children(0.0)
    cands = [Candidate(int(t), float(s), -1, 1) for s, t in zip(sc, tok)]
    front, out = list(range(K)), [list(cands)]
    for depth in range(2, depths + 1):
        first = len(cands)
        for f in front:
            sc, tok = children(cands[f].score)
            cands += [Candidate(int(t), float(s), f, depth) for s, t in zip(sc, tok)]
        new = sorted(range(first, len(cands)), key=lambda i: -cands[i].score)[:K]
        front = new
        out.append(list(cands))
    return out


def test_a_final_tree_does_not_change_with_more_depths():
    rng = torch.Generator().manual_seed(0)
    fired = 0
    for trial in range(300):
        K, n = (4, 7) if trial % 2 else (3, 4)
        stages = _expand(rng, K, depths=5)
        full = select_tree(0, stages[-1], n)
        for d, cands in enumerate(stages[:-1], start=1):
            frontier_best = max(c.score for c in cands if c.depth == d)
            if tree_is_final(cands, n, frontier_best):
                fired += 1
                assert select_tree(0, cands, n) == full, (trial, d)
    assert fired > 100  # the exit is not vacuous on such trees
    # fewer candidates than nodes wanted: never final
    assert not tree_is_final(_cands()[:2], 4, -10.0)
    assert tree_is_final(_cands(), 4, math.log(0.27)) and not tree_is_final(_cands(), 4, math.log(0.28))
