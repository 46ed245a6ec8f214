"""Proposing drafts: chains (topk = 1) and EAGLE-2 trees, eagerly or on static buffers (CUDA graphs).

Eager: the head runs step by step from the catch-up's output ``h``, reading each step's tokens back.
Static: the chain loop / tree expansion run on the device from ``h0``; their drafts stay there
(PENDING on the host) until the next verify writes them into its input ids.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from specserve.attention.base import forward_context
from specserve.engine import sampler
from specserve.engine.host_copy import host_to_device
from specserve.engine.request import Request
from specserve.speculative.catch_up import CatchUp
from specserve.speculative.state import PENDING
from specserve.speculative.tree import Candidate, DraftTree, select_tree, tree_is_final


def pend(todo: list[tuple[Request, int]], toks: torch.Tensor, rows: list[int]) -> None:
    """Chains left on the device: row ``rows[i]`` of ``toks`` for request i."""
    for (r, k), i in zip(todo, rows):
        r.draft_token_ids = [PENDING] * k
        r.draft_tree = None
        r.spec.draft_probs = None
        r.spec.device_drafts = (toks, i)


def pend_trees(todo: list[tuple[Request, int]], trees: torch.Tensor, rows: list[int]) -> None:
    """Trees left on the device: row ``rows[i]`` of packed ``trees``; on the host a chain-shaped
    placeholder of as many nodes (the verify fills positions and mask on the device)."""
    for (r, k), i in zip(todo, rows):
        r.draft_token_ids = [PENDING] * k
        r.draft_tree = DraftTree([r.all_token_ids[-1]] + [PENDING] * k, list(range(-1, k)), list(range(k + 1)))
        r.spec.draft_probs = None
        r.spec.device_drafts = None
        r.spec.device_tree = (trees, i)


class Proposer:
    def __init__(self, head, embed, catch_up: CatchUp, tree_attn, topk: int, num_steps: int, vocab_size: int,
                 generator: torch.Generator | None, device: torch.device, path_counts: Counter) -> None:
        self.head, self.embed, self.catch_up, self.tree_attn = head, embed, catch_up, tree_attn
        self.topk, self.num_steps, self.vocab_size = topk, num_steps, vocab_size
        self.generator, self.device, self.path_counts = generator, device, path_counts
        self.chain_runner: Any = None  # ChainDraftRunner / TreeDraftRunner, where built
        self.tree_runner: Any = None

    def propose(self, todo: list[tuple[Request, int]], h: torch.Tensor) -> None:
        """Draft k tokens for each (request, k) after its catch-up (output ``h``)."""
        if self.tree_runner is not None:
            self._tree_static(todo)
        elif self.topk > 1:
            self._tree(todo, h)
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

    def _tree_static(self, todo: list[tuple[Request, int]]) -> None:
        reqs = [r for r, _ in todo]
        path = self.tree_runner.run_device([r.num_tokens - 1 for r in reqs], [r.kv.block_table for r in reqs],
                                           [k for _, k in todo])
        self.path_counts[f"tree:{path}"] += 1
        pend_trees(todo, self.tree_runner.trees[: len(reqs)].clone(), list(range(len(reqs))))

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
            pos = [r.num_tokens + j - 3 for r in sub]
            emb = self.embed(host_to_device([drafts[i][-1] for i in active], self.device))
            h_sub = self.catch_up.run_head(sub, [1] * len(sub), pos, [p + 1 for p in pos], emb, h[idx])
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

    def _tree(self, todo: list[tuple[Request, int]], h: torch.Tensor) -> None:
        """EAGLE-2: expand the topk best frontier nodes per depth; keep the best k candidates."""
        reqs = [r for r, _ in todo]
        B, K, dev = len(reqs), self.topk, self.device
        score, tok = self.head.top_drafts(h, K)  # [B, K]
        sc_l, tok_l = score.tolist(), tok.tolist()
        cands = [[Candidate(tok_l[b][i], sc_l[b][i], -1, 1) for i in range(K)] for b in range(B)]
        front_cand = [list(range(K)) for _ in range(B)]
        front_best = [sc_l[b][0] for b in range(B)]  # the frontier's best score (topk sorts)
        front_h = h[:, None, :].expand(B, K, h.shape[-1]).reshape(B * K, -1)
        front_tok, front_score = tok, score
        self.tree_attn.begin([r.kv.block_table for r in reqs], [r.num_computed_tokens for r in reqs], K)
        anc = None
        for depth in range(2, self.num_steps + 1):
            if all(tree_is_final(cands[b], k, front_best[b]) for b, (_, k) in enumerate(todo)):
                self.path_counts["tree:depths_skipped"] += self.num_steps + 1 - depth
                break
            pos = torch.tensor([r.num_tokens + depth - 3 for r in reqs], device=dev).repeat_interleave(K)
            self.tree_attn.set_ancestors(anc)
            with forward_context(self.tree_attn):
                h_out = self.head(self.embed(front_tok.reshape(-1)), front_h, pos)
            c_score, c_tok = self.head.top_drafts(h_out, K)  # [B*K, K]
            c_score = (front_score.reshape(-1, 1) + c_score).reshape(B, K * K)
            c_tok = c_tok.reshape(B, K * K)
            best_score, best = c_score.topk(K, dim=-1)  # next frontier [B, K]
            cs_l, ct_l, best_l = c_score.tolist(), c_tok.tolist(), best.tolist()
            new_front = []
            for b in range(B):
                first = len(cands[b])
                cands[b].extend(Candidate(ct_l[b][c], cs_l[b][c], front_cand[b][c // K], depth) for c in range(K * K))
                new_front.append([first + c for c in best_l[b]])
            front_cand = new_front
            front_best = [cs_l[b][best_l[b][0]] for b in range(B)]
            parent = best // K  # which current query each new frontier node hangs under [B, K]
            onehot = torch.nn.functional.one_hot(parent, K).bool()
            anc = onehot if anc is None else torch.cat(
                [anc.gather(1, parent[:, :, None].expand(-1, -1, anc.shape[2])), onehot], 2)
            front_h = h_out.view(B, K, -1).gather(1, parent[:, :, None].expand(-1, -1, h_out.shape[-1]))
            front_h = front_h.reshape(B * K, -1)
            front_tok, front_score = c_tok.gather(1, best), best_score
        for (r, k), c in zip(todo, cands):
            r.draft_tree = select_tree(r.all_token_ids[-1], c, k)
            r.draft_token_ids = r.draft_tree.tokens[1:]
