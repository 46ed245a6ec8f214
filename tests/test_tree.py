"""EAGLE-2 tree selection and verification on hand-made tables."""

import math

import torch

from specserve.speculative.accept import accept_greedy, accept_tree_sampled
from specserve.speculative.tree import DraftTree, select_trees, tree_fields, tree_width


def lg(p):
    return math.log(p)


def _tree(num_nodes: int = 4) -> DraftTree:
    """select_trees over hand-made candidates (token, cumulative log-probability, parent, depth)."""
    # root children: a (0.6), b (0.3); a's children: c (0.5 -> 0.30), d (0.4 -> 0.24); b's child: e (0.9 -> 0.27)
    cands = [
        (10, lg(0.6), -1, 1),  # 0: a
        (11, lg(0.3), -1, 1),  # 1: b
        (12, lg(0.6 * 0.5), 0, 2),  # 2: c
        (13, lg(0.6 * 0.4), 0, 2),  # 3: d
        (14, lg(0.3 * 0.9), 1, 2),  # 4: e
        (15, lg(0.3 * 0.05), 1, 2),  # 5: f
    ]
    tok, score, par, dep = (torch.tensor([[c[i] for c in cands]]) for i in range(4))
    out = torch.zeros(1, tree_width(num_nodes + 1), dtype=torch.long)
    select_trees(tok, score.float(), par, dep[0], num_nodes + 1, 2, out)
    t, p, d, _ = tree_fields(out, num_nodes + 1)
    return DraftTree([7] + t[0, 1:].tolist(), [-1] + p[0, 1:].tolist(), d[0].tolist())


def test_select_keeps_best_by_cumulative_prob_and_orders_by_depth():
    t = _tree()
    # best 4 by cumulative probability: a .6, b .3, c .3, e .27 (d .24 and f .015 dropped)
    assert t.tokens == [7, 10, 11, 12, 14]
    assert t.parents == [-1, 0, 0, 1, 2]
    assert t.depths == [0, 1, 1, 2, 2]
    assert t.children(0) == [1, 2] and t.children(1) == [3] and t.children(2) == [4]


def test_mask_is_ancestor_or_self():
    t = _tree()
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
    t = _tree()  # nodes: 1=a(10) 2=b(11) 3=c(12, under a) 4=e(14, under b)
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

