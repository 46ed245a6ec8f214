"""Drafts: chains (topk = 1, or a tree engine's chain arms), eagerly from the catch-up's ``h`` (a read-back a step)
or on static buffers from ``h0``, and EAGLE-2 trees on static buffers; static drafts stay on the device (PENDING on
the host) until the verify."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from specserve.engine import sampler
from specserve.engine.host_copy import host_to_device
from specserve.engine.request import Request
from specserve.speculative.catch_up import CatchUp, catch_up_slots
from specserve.speculative.state import PENDING
from specserve.speculative.tree import DraftTree, tree_fields


def pend(todo: list[tuple[Request, int]], toks: torch.Tensor, rows: list[int], tree: bool = False) -> None:
    """Drafts left on the device: row ``rows[i]`` of ``toks`` for request i, chains [B, K] or packed trees (on
    the host a tree is a chain-shaped placeholder of as many nodes: the verify fills positions and mask)."""
    for (r, k), i in zip(todo, rows):
        r.draft_token_ids = [PENDING] * k
        r.draft_tree = DraftTree.chain(r.all_token_ids[-1], [PENDING] * k) if tree else None
        r.spec.draft_probs = None
        r.spec.device_drafts = None if tree else (toks, i)
        r.spec.device_tree = (toks, i) if tree else None


class Proposer:
    def __init__(self, head, embed, catch_up: CatchUp, topk: int, vocab_size: int, generator: torch.Generator | None,
                 device: torch.device, path_counts: Counter) -> None:
        self.head, self.embed, self.catch_up = head, embed, catch_up
        self.topk, self.vocab_size = topk, vocab_size
        self.generator, self.device, self.path_counts = generator, device, path_counts
        self.chain_runner: Any = None  # ChainDraftRunner: the static draft loop, where built
        self.tree_runner: Any = None  # TreeDraftRunner: every tree's expansion

    def propose(self, todo: list[tuple[Request, int]], h: torch.Tensor, tree: bool) -> None:
        """Draft k tokens for each (request, k) after its catch-up (output ``h``): a chain, or (a tree engine)
        a tree of k nodes."""
        if tree:
            self._tree(todo)
        elif self.chain_runner is not None and all(r.params.greedy and r.grammar is None for r, _ in todo):
            self._chain_static(todo)
        else:
            self._chain(todo, h)

    def _chain_static(self, todo: list[tuple[Request, int]]) -> None:
        reqs = [r for r, _ in todo]
        toks, path = self.chain_runner.run([r.num_tokens - 1 for r in reqs], [k for _, k in todo],
                                           [r.kv.block_table for r in reqs])
        self.path_counts[f"chain:{path}"] += 1
        pend(todo, toks.clone(), list(range(len(todo))))  # (the loop's buffer is rewritten by its next run)

    def _tree(self, todo: list[tuple[Request, int]]) -> None:
        """EAGLE-2 trees, expanded and selected on static buffers from h0 (tree_graph.py): left on the device
        with the static draft loop (the verify reads them there), else read back as host trees."""
        reqs, tr = [r for r, _ in todo], self.tree_runner
        path = tr.run_device([r.num_tokens - 1 for r in reqs], [r.kv.block_table for r in reqs], [k for _, k in todo])
        if self.chain_runner is not None:
            self.path_counts[f"tree:{path}"] += 1
            pend(todo, tr.trees[: len(reqs)].clone(), list(range(len(reqs))), tree=True)
            return
        tok, par, dep, _ = (t.tolist() for t in tree_fields(tr.trees[: len(reqs)], tr.num_nodes))
        for b, (r, k) in enumerate(todo):
            r.draft_tree = DraftTree([r.all_token_ids[-1]] + tok[b][1 : k + 1], [-1] + par[b][1 : k + 1],
                                     [0] + dep[b][1 : k + 1])
            r.draft_token_ids = r.draft_tree.tokens[1:]

    def _pick(self, reqs: list[Request], logits: torch.Tensor, step: int) -> tuple[list[int], list[torch.Tensor | None]]:
        """Draft ``step`` (1: the first) per request (target ids) and, for sampled requests, its distribution
        q. A seeded request's draft uses the noise its verify row will (the same output index). A request with
        a grammar drafts what it allows (and moves along its drafts, tentatively)."""
        grammars = [r.grammar for r in reqs]
        if any(g is not None for g in grammars):
            from specserve.structured.matcher import mask_draft_logits

            mask_draft_logits(grammars, logits, self.head.draft_to_target(
                torch.arange(logits.shape[1], device=logits.device)))
            picks = self._draw(reqs, logits, step)
            for g, t in zip(grammars, picks[0]):
                if g is not None:
                    g.draft(t)
            return picks
        return self._draw(reqs, logits, step)

    def _draw(self, reqs: list[Request], logits: torch.Tensor, step: int
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        if all(r.params.greedy for r in reqs):
            return self.head.draft_to_target(logits.argmax(-1)).tolist(), [None] * len(reqs)
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"), device=logits.device)
        full[:, self.head.draft_to_target(torch.arange(logits.shape[1], device=logits.device))] = logits
        sb = sampler.SamplingBatch.build([r.params for r in reqs],
                                         [r.num_tokens - r.num_prompt_tokens + step - 1 for r in reqs], self.device)
        q = sampler.processed_probs(full, sb)
        toks = sampler.draw(q, sb, self.generator).tolist()
        return toks, [None if r.params.greedy else q[i] for i, r in enumerate(reqs)]

    def _chain(self, todo: list[tuple[Request, int]], h: torch.Tensor) -> None:
        reqs = [r for r, _ in todo]
        toks, qs = self._pick(reqs, self.head.compute_logits(h), 1)
        drafts, dprobs = [[t] for t in toks], [[q] for q in qs]
        active = list(range(len(reqs)))
        for j in range(2, max(k for _, k in todo) + 1):  # draft step j runs at position num_tokens + j - 3
            active = [i for i in active if todo[i][1] >= j]
            if not active:
                break
            sub = [reqs[i] for i in active]
            idx = host_to_device(active, self.device)
            starts = [r.num_tokens + j - 3 for r in sub]
            pos, slots = catch_up_slots(sub, starts, [1] * len(sub), self.catch_up.block_size)
            emb = self.embed(host_to_device([drafts[i][-1] for i in active], self.device))
            h_sub = self.catch_up.run_head(sub, [1] * len(sub), pos, (pos + 1).tolist(), emb, h[idx],
                                           host_to_device(slots, self.device))
            h = h.index_copy(0, idx, h_sub)
            toks, qs = self._pick(sub, self.head.compute_logits(h_sub), j)
            for i, t, q in zip(active, toks, qs):
                drafts[i].append(t)
                dprobs[i].append(q)
        for i, r in enumerate(reqs):
            if r.grammar is not None:
                r.grammar.end_drafts()
            r.draft_token_ids = drafts[i]
            r.draft_tree = None
            r.spec.draft_probs = None if r.params.greedy or r.params.seeded else torch.stack(dprobs[i])
