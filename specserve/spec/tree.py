"""EAGLE-2 dynamic draft trees: selection, attention mask, verification.

Drafting expands, at each step, the ``topk`` best frontier nodes by cumulative draft
log-probability; every child seen becomes a candidate. The tree keeps the best
``num_draft_tokens - 1`` candidates (an ancestor never scores below its descendant, so the set is
closed under parents) below a root that is the request's last committed token.

Verification walks from the root: greedy follows the child equal to the target's argmax;
sampling tries children in order, accepting child c with probability p(c) and otherwise removing
c from p (renormalised) before trying the next: lossless for deterministic (top-k) proposals.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Candidate:
    token: int  # target vocab id
    score: float  # cumulative draft log-probability
    parent: int  # candidate index of the parent, -1 for a child of the root
    depth: int  # 1 for children of the root


@dataclass
class DraftTree:
    """Nodes 1..n below root 0, parents before children."""

    tokens: list[int]  # tokens[0] is the root (last committed token)
    parents: list[int]  # parents[0] == -1
    depths: list[int]  # depths[0] == 0

    @property
    def num_nodes(self) -> int:
        return len(self.tokens) - 1

    def truncated(self, num_nodes: int) -> "DraftTree":
        """The first ``num_nodes`` nodes (depth order keeps every parent)."""
        n = num_nodes + 1
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n])

    def children(self, i: int) -> list[int]:
        return [j for j in range(1, len(self.tokens)) if self.parents[j] == i]

    def ancestor_bits(self) -> list[int]:
        """Per node i: bit j set iff j is i or an ancestor of i (parents come before children)."""
        bits: list[int] = []
        for i, p in enumerate(self.parents):
            bits.append((bits[p] if p >= 0 else 0) | (1 << i))
        return bits

    def mask(self) -> torch.Tensor:
        """bool [n+1, n+1]: row i may attend column j iff j is i or an ancestor of i."""
        n = len(self.tokens)
        if n > 64:
            raise ValueError(f"a tree of {n} tokens: at most 64 (one 64-bit word of ancestors per token)")
        bits = np.array(self.ancestor_bits(), dtype=np.uint64)
        cols = np.left_shift(np.uint64(1), np.arange(n, dtype=np.uint64))
        return torch.from_numpy((bits[:, None] & cols[None, :]) != 0)


def select_tree(root_token: int, cands: list[Candidate], num_nodes: int) -> DraftTree:
    """The best ``num_nodes`` candidates as a tree (ties: shallower first, then earlier)."""
    order = sorted(range(len(cands)), key=lambda i: (-cands[i].score, cands[i].depth, i))[:num_nodes]
    chosen = set(order)
    for i in order:  # closure under parents (holds already unless scores tie oddly)
        p = cands[i].parent
        while p != -1 and p not in chosen:
            chosen.add(p)
            p = cands[p].parent
    nodes = sorted(chosen, key=lambda i: (cands[i].depth, -cands[i].score, i))
    index = {c: k + 1 for k, c in enumerate(nodes)}
    return DraftTree(
        tokens=[root_token] + [cands[c].token for c in nodes],
        parents=[-1] + [0 if cands[c].parent == -1 else index[cands[c].parent] for c in nodes],
        depths=[0] + [cands[c].depth for c in nodes],
    )


def tree_is_final(cands: list[Candidate], num_nodes: int, frontier_best: float) -> bool:
    """Whether expanding the frontier further can change ``select_tree(cands, num_nodes)``.

    Every later node descends from a frontier node and scores at most its score (log-probabilities
    only add non-positive terms), so once ``num_nodes`` candidates score at least the best frontier
    node, no later node enters the selection (a tie goes to the shallower node): the remaining
    depths would be drafted for nothing. Exact, not a heuristic."""
    if len(cands) < num_nodes:
        return False
    return heapq.nlargest(num_nodes, (c.score for c in cands))[-1] >= frontier_best


@dataclass
class TreeVerifyResult:
    path: list[int]  # accepted node indices (excluding the root), root-to-leaf order
    tokens: list[int]  # accepted tokens + one token from the target
    num_accepted: int


def verify_tree_greedy(tree: DraftTree, target_argmax: list[int]) -> TreeVerifyResult:
    """target_argmax[i]: the target's argmax at node i (row i of the verify)."""
    node, path = 0, []
    while True:
        want = target_argmax[node]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    toks = [tree.tokens[i] for i in path] + [target_argmax[node]]
    return TreeVerifyResult(path, toks, len(path))


def verify_tree_sampled(tree: DraftTree, probs: torch.Tensor, gen: torch.Generator | None) -> TreeVerifyResult:
    """probs [n+1, V]: the target's processed distribution at each node."""
    node, path = 0, []
    while True:
        p = probs[node].clone()
        accepted = None
        for c in tree.children(node):
            tok = tree.tokens[c]
            mass = float(p.sum())
            if mass <= 0:
                break
            u = float(torch.rand((), generator=gen, device=p.device))
            if u * mass < float(p[tok]):
                accepted = c
                break
            p[tok] = 0.0  # rejected: draw the rest from p without this token
        if accepted is None:
            if float(p.sum()) <= 0:
                p = probs[node]
            tok = int(torch.multinomial(p / p.sum(), 1, generator=gen))
            return TreeVerifyResult(path, [tree.tokens[i] for i in path] + [tok], len(path))
        path.append(accepted)
        node = accepted
