"""A request's grammar state, and the masks of a step's rows.

The matcher accepts committed tokens only. A verify's rows follow the drafts: row i (the target's
logits after node i of the draft tree, root 0 = the last committed token) is masked by the grammar's
state after the path root -> i; xgrammar walks the tree from the committed state and leaves it there.
Rows below a draft the grammar rejects allow everything: no acceptance rule can reach them.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

from specserve.speculative.tree import DraftTree


class GrammarViolation(RuntimeError):
    """A committed token the grammar does not allow (a mask was not applied where it should have been)."""


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar, request_id: str = "") -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.request_id = request_id

    def accept(self, token: int) -> None:
        """A committed token (the scheduler's commit, through ``Request.append_token``)."""
        if not self.matcher.accept_token(token):
            raise GrammarViolation(f"request {self.request_id}: token {token} breaks its grammar")

    @property
    def terminated(self) -> bool:
        """The grammar ended (a stop token was accepted where it completes)."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, tree: DraftTree) -> None:
        """bitmask [tree.num_nodes + 1, words]: row i = what may follow the path root -> node i."""
        n = len(tree.tokens)
        first_child, next_sibling = [-1] * n, [-1] * n
        for j in range(n - 1, 0, -1):  # parents come before children: the first child ends up first
            p = tree.parents[j]
            next_sibling[j], first_child[p] = first_child[p], j
        self.matcher.traverse_draft_tree(torch.tensor(first_child, dtype=torch.int64),
                                         torch.tensor(next_sibling, dtype=torch.int64),
                                         torch.tensor(tree.tokens, dtype=torch.int64), bitmask)
        bitmask[(bitmask == 0).all(dim=1)] = -1  # rows xgrammar did not reach (below a rejected draft)


def mask_rows(logits: torch.Tensor, spans: list[tuple[int, GrammarState, DraftTree]], vocab_size: int) -> None:
    """Mask ``logits`` [N, V] in place: per (first row, state, tree) the rows first .. first + n_nodes."""
    if not spans:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab_size)
    rows: list[int] = []
    for first, state, tree in spans:
        n = len(tree.tokens)
        state.fill(bitmask[first : first + n], tree)
        rows.extend(range(first, first + n))
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab_size,
                                    indices=rows)


def mask_step(logits: torch.Tensor, rows: list[tuple[GrammarState | None, DraftTree | None]], vocab_size: int) -> None:
    """A step's logits [N, V], each request's rows in turn: (its grammar or None, its draft tree, None for a
    plain token: one row). Constrained requests' rows are masked in place; the others are left alone."""
    spans, off = [], 0
    for state, tree in rows:
        n = 1 if tree is None else len(tree.tokens)
        if state is not None:
            spans.append((off, state, tree if tree is not None else DraftTree.chain(0, [])))
        off += n
    mask_rows(logits, spans, vocab_size)
