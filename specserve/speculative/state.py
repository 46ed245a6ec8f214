"""Per-request speculation state (``Request.spec``) and the placeholder of a draft still on the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specserve.engine.request import Request

# a draft token whose value is still on the device (draft_token_ids keep the count on the host)
PENDING = -1


@dataclass
class DraftState:
    """What the drafter keeps for one request; created at its first step, dropped when it ends."""

    draft_pos: int  # first position without draft KV (its target feature is in the feature store)
    draft_probs: torch.Tensor | None = None  # [k, V] q of the current drafts (sampled requests only)
    # (drafts [B, K], row): a chain left on the device; its draft_token_ids hold PENDING until the verify
    device_drafts: tuple[torch.Tensor, int] | None = None
    # (packed trees [B, tree_width], row): a tree selected on the device; draft_tree is a placeholder
    device_tree: tuple[torch.Tensor, int] | None = None


def state_of(r: Request) -> DraftState:
    """``r``'s state, created at its first position without draft KV (past a cached prefix's)."""
    if r.spec is None:
        start = r.num_computed_tokens if r.draft_kv_tokens is None else min(r.draft_kv_tokens, r.num_computed_tokens)
        r.spec = DraftState(draft_pos=start)
    return r.spec


def catch_up_end(r: Request) -> int:
    """Last committed position of ``r`` whose next token is known (its KV may run past its last token
    when it stopped inside the drafts it accepted)."""
    return min(r.num_computed_tokens, r.num_tokens - 1)


@dataclass
class EarlyVerify:
    """A verify launched before the step that runs it was scheduled (pipeline.py)."""

    plan: list[tuple[str, int, int, int]]  # per request: id, first position, first token, drafts
    blocks: list[list[int]]  # per request: the blocks its KV went to
    reqs: list[Request]
    inputs: Any  # StepInputs
    out: Any  # the forward's output (hidden, features)
    logits: torch.Tensor
    argmax: torch.Tensor
    draft_rows: torch.Tensor  # input rows holding drafts, in request order
    toks: torch.Tensor  # the drafts it read (chains [B, K], or packed trees)
    tree_extra: torch.Tensor | None = None  # trees: their parents and depths, read back with the picks


class Caps:
    """How many tokens a request may draft: max_k, its max_spec_tokens, what is left of max_tokens and
    of the model length. A tree drafts all its nodes while max_tokens leaves it any token; a chain (in a
    tree engine too: the adaptive policy's chain arms) no more than max_tokens leaves."""

    def __init__(self, max_k: int, topk: int, num_steps: int, max_model_len: int) -> None:
        self.max_k, self.topk, self.num_steps, self.max_model_len = max_k, topk, num_steps, max_model_len

    def most_committed(self, k: int) -> int:
        """The most tokens a verify of ``k`` drafts commits: k + 1 for a chain, a tree's depth + 1 (a chain
        in a tree engine is no deeper than a tree)."""
        return (k if self.topk == 1 else min(k, self.num_steps)) + 1

    def _tree(self, tree: bool | None) -> bool:
        return self.topk > 1 if tree is None else tree

    def cap(self, r: Request, committed: int = 0, tree: bool | None = None) -> int:
        """The most ``r`` may draft once ``committed`` more tokens are committed, as a tree (None: the
        engine's kind) or a chain."""
        p = r.params
        cap = self.max_k if p.max_spec_tokens is None else min(self.max_k, p.max_spec_tokens)
        if p.max_tokens is not None:
            left = p.max_tokens - (r.num_output_tokens + committed) - 1
            if not self._tree(tree) or left <= 0:
                cap = min(cap, left)
        return max(min(cap, self.max_model_len - (r.num_tokens + committed) - 1), 0)

    def after_verify(self, r: Request, k: int, drafts: int, tree: bool | None = None) -> int:
        """min(drafts, r's cap) whatever a verify of ``k`` drafts commits (the cap after the most it can
        commit); a tree (None: the engine's kind) drafts whole (its nodes must fit the model length after
        its depth + bonus)."""
        most = self.most_committed(k)
        if not self._tree(tree):
            return min(drafts, self.cap(r, most, tree=False))
        fits = self.max_model_len - (r.num_tokens + most) - 1 >= drafts
        return min(drafts, self.cap(r, 1, tree=True)) if fits else 0
