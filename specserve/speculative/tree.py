"""EAGLE-2 dynamic draft trees: the best ``num_draft_tokens - 1`` candidates by cumulative draft log-probability
below the last committed token (closed under parents), their mask and packed device form."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DraftTree:
    """Nodes 1..n below root 0, parents before children."""

    tokens: list[int]  # tokens[0] is the root (last committed token)
    parents: list[int]  # parents[0] == -1
    depths: list[int]  # depths[0] == 0

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> "DraftTree":
        """A chain as a tree: node i hangs under node i - 1."""
        return cls([root] + list(drafts), list(range(-1, len(drafts))), list(range(len(drafts) + 1)))

    def truncated(self, num_nodes: int) -> "DraftTree":
        """The first ``num_nodes`` nodes (depth order keeps every parent)."""
        n = num_nodes + 1
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n])

    def children(self, i: int) -> list[int]:
        return [j for j in range(1, len(self.tokens)) if self.parents[j] == i]

    def mask(self) -> torch.Tensor:
        """bool [n+1, n+1]: row i may attend column j iff j is i or an ancestor of i."""
        n = len(self.tokens)
        if n > 64:
            raise ValueError(f"a tree of {n} tokens: at most 64 (one 64-bit word of ancestors per token)")
        bits: list[int] = []  # per node i: bit j set iff j is i or an ancestor of i (parents come first)
        for i, p in enumerate(self.parents):
            bits.append((bits[p] if p >= 0 else 0) | (1 << i))
        bits = np.array(bits, dtype=np.uint64)
        cols = np.left_shift(np.uint64(1), np.arange(n, dtype=np.uint64))
        return torch.from_numpy((bits[:, None] & cols[None, :]) != 0)


def tree_width(num_nodes: int) -> int:
    """Packed trees [B, 4 * N]: per request its tokens | parents (the root's: 0) | depths | ancestor bits
    (bit j set iff node j is it or an ancestor: a mask row as the Triton attention reads it)."""
    return 4 * num_nodes


def tree_fields(packed: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, parents, depths, ancestor bits) [B, N] views of packed trees [B, tree_width(N)]."""
    N = num_nodes
    return packed[:, :N], packed[:, N : 2 * N], packed[:, 2 * N : 3 * N], packed[:, 3 * N : 4 * N]


def select_trees(cand_tok: torch.Tensor, cand_score: torch.Tensor, cand_parent: torch.Tensor,
                 cand_depth: torch.Tensor, num_nodes: int, max_depth: int, out: torch.Tensor,
                 sizes: torch.Tensor | None = None) -> None:
    """The best num_nodes - 1 candidates of every row as a tree (ties: shallower first, then earlier): candidates
    [B, C] of depths ``cand_depth`` [C] into packed trees ``out`` (nodes 1..N-1 in depth order; ``sizes`` [B]:
    fewer drafts, the best first). A node's parent scores at least as high, so the best are closed under parents."""
    B, C = cand_score.shape
    M = num_nodes - 1
    if M > C:
        raise ValueError(f"a tree of {num_nodes} tokens from {C} candidates")
    dev = cand_score.device
    best = torch.sort(cand_score, dim=1, descending=True, stable=True).indices[:, :M]  # [B, M]
    rank = torch.arange(M, device=dev)
    key = cand_depth[best] * M + rank
    if sizes is not None:
        key = torch.where(rank[None, :] < sizes[:, None], key, (max_depth + 1) * M + rank)
    order = key.argsort(dim=1)
    nodes = best.gather(1, order)  # candidate index of node 1 .. M
    cpar = cand_parent.gather(1, nodes)
    index = torch.zeros(B, C, dtype=torch.long, device=dev)
    index.scatter_(1, nodes, (rank + 1).expand(B, M))  # candidate -> node index
    parents = torch.where(cpar < 0, 0, index.gather(1, cpar.clamp(min=0)))
    tok, par, dep, bits = tree_fields(out[:B], num_nodes)
    # nodes 1..M only: the roots' columns stay as ``out`` holds them (zeros in a zeroed buffer)
    tok[:, 1:] = cand_tok.gather(1, nodes)
    par[:, 1:] = parents
    dep[:, 1:] = cand_depth[nodes]
    own = torch.ones(num_nodes, dtype=torch.long, device=dev) << torch.arange(num_nodes, device=dev)
    anc = own.expand(B, -1)
    for _ in range(max_depth - 1):  # a node's bits = its own | its parent's: exact after max_depth rounds
        anc = own | anc.gather(1, par)
    torch.bitwise_or(own, anc.gather(1, par), out=bits)
