"""A request's grammar: its state over the committed output, and the masks of its rows in a step.

The matcher accepts committed tokens only (``Request.append_token``). As a logits processor
(engine/logits_process.py) it masks each of the request's rows in a step: row i by the grammar's state
after the committed output and row i's draft prefix (plain step: one row, no drafts; a verify: every
drafted position and the bonus row, chain or tree). xgrammar walks the draft tree from the committed
state and leaves it there. Rows below a draft the grammar rejects allow everything: no acceptance rule
can reach them (the rejected draft's own probability is 0 at its parent's row).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
import xgrammar as xgr

from specserve.speculative.tree import DraftTree


class GrammarViolation(RuntimeError):
    """A committed token the grammar does not allow (a row was sampled without its mask)."""


def prefix_tree(prefixes: list[list[int]]) -> DraftTree:
    """Rows' draft prefixes as a tree: [[], [a], [a, b], [c]] -> tokens [0, a, b, c], parents [-1, 0, 1, 0]."""
    index = {(): 0}
    tokens, parents, depths = [0], [-1], [0]
    for i, p in enumerate(prefixes[1:], start=1):
        index[tuple(p)] = i
        tokens.append(p[-1])
        parents.append(index[tuple(p[:-1])])
        depths.append(len(p))
    return DraftTree(tokens, parents, depths)


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar | Future, vocab_size: int, request_id: str = "") -> None:
        self._compiled = compiled  # (a future while the compiler's thread works on it)
        self._matcher: xgr.GrammarMatcher | None = None
        self.vocab_size = vocab_size
        self.request_id = request_id
        self.num_accepted = 0
        self._drafts = 0  # drafts accepted tentatively; -1 - n once draft n + 1 left the grammar

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            c = self._compiled
            self._matcher = xgr.GrammarMatcher(c.result() if isinstance(c, Future) else c)
            self._compiled = None
        return self._matcher

    def accept(self, token: int) -> None:
        """A committed token."""
        if not self.matcher.accept_token(token):
            raise GrammarViolation(f"request {self.request_id}: token {token} breaks its grammar")
        self.num_accepted += 1

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

    # -- drafts: proposed under the grammar too (tentative: rolled back before the verify) ---------------
    def draft_mask(self, bitmask_row: torch.Tensor) -> bool:
        """Fill [words] with what may follow the committed tokens and the drafts so far; False (row left
        as it is) once a draft left or ended the grammar."""
        if self._drafts < 0 or self.matcher.is_terminated():  # (a draft EOS ended it)
            return False
        self.matcher.fill_next_token_bitmask(bitmask_row[None])
        return True

    def draft(self, token: int) -> None:
        if self._drafts >= 0:
            ok = not self.matcher.is_terminated() and self.matcher.accept_token(token)
            self._drafts = self._drafts + 1 if ok else -1 - self._drafts

    def end_drafts(self) -> None:
        """Back to the committed state."""
        n = self._drafts if self._drafts >= 0 else -1 - self._drafts
        if n:
            self.matcher.rollback(n)
        self._drafts = 0

    def apply(self, logits: torch.Tensor, rows) -> None:
        """The logits processor (logits_process.LogitsProcessor): ``logits`` [n, V] of ``rows``
        (a RequestRows), masked in place."""
        if len(rows.output) != self.num_accepted:
            raise RuntimeError(f"request {self.request_id}: its grammar has seen {self.num_accepted} of "
                               f"{len(rows.output)} committed tokens")
        bitmask = xgr.allocate_token_bitmask(len(rows.drafts), self.vocab_size)
        self.fill(bitmask, prefix_tree(rows.drafts))
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=self.vocab_size)


def mask_draft_logits(states: list[GrammarState | None], logits: torch.Tensor, target_ids: torch.Tensor) -> None:
    """A draft step's head logits [B, Vd] (draft vocab; ``target_ids`` [Vd] their target ids), each row of
    a constrained request masked in place by its grammar after its drafts so far (none left: unmasked)."""
    rows = [i for i, st in enumerate(states) if st is not None]
    bitmask = xgr.allocate_token_bitmask(len(rows), states[rows[0]].vocab_size)
    keep = [i for j, i in enumerate(rows) if states[i].draft_mask(bitmask[j])]
    if not keep:
        return
    ids = target_ids.cpu()
    bm = bitmask[[rows.index(i) for i in keep]]
    ok = ((bm[:, ids // 32] >> (ids % 32).to(torch.int32)) & 1).bool()  # [R, Vd]
    ok |= ~ok.any(dim=1, keepdim=True)  # nothing the grammar allows in the draft vocab: leave the row open
    idx = torch.tensor(keep, device=logits.device)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill(~ok.to(logits.device), float("-inf")))

