"""Acceptance of drafts: one greedy and one sampled rule per proposal kind, on the host and on the device.

Greedy: follow the child equal to the target's argmax from the root; the argmax at the last accepted
node is the bonus token. A chain is a tree whose node i hangs under node i - 1.
Sampled chains (drafts drawn from q): accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the
first rejection draw from norm(max(0, p_j - q_j)), else the bonus from p_{k+1}.
Sampled trees (deterministic top-k proposals): try children in order, accepting c with probability
p(c), else remove c from p. Both follow exactly what plain sampling would.
Seeded requests take the greedy rule over their picks: at each row the token plain sampling draws
there (sampler.picks: a function of the seed and the output index), so their outputs are the same
token for token with speculation on or off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.kv_cache import kv_slot
from specserve.speculative.tree import DraftTree


@dataclass
class Accepted:
    path: list[int]  # accepted node indices (excluding the root), root-to-leaf order
    tokens: list[int]  # accepted tokens + one token from the target
    num_accepted: int


def accept_greedy(tree: DraftTree, target_argmax: list[int]) -> Accepted:
    """target_argmax[i]: the target's argmax at node i (row i of the verify)."""
    node, path = 0, []
    while True:
        want = target_argmax[node]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return Accepted(path, [tree.tokens[i] for i in path] + [target_argmax[node]], len(path))


def accept_tree_sampled(tree: DraftTree, probs: torch.Tensor, gen: torch.Generator | None) -> Accepted:
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
            return Accepted(path, [tree.tokens[i] for i in path] + [tok], len(path))
        path.append(accepted)
        node = accepted


def accept_chains_sampled(probs: torch.Tensor, drafts: list[list[int]], qs: list[torch.Tensor],
                          gen: torch.Generator | None) -> list[Accepted]:
    """Rejection sampling for R chains at once: ``probs`` [sum(k_i + 1), V] the target's processed distribution
    at each chain's rows in turn, ``drafts[i]`` its k_i drafts drawn from ``qs[i]`` [>= k_i, V]."""
    dev, V = probs.device, probs.shape[1]
    R, K = len(drafts), max(len(d) for d in drafts)
    idx, first = [], 0  # [R, K + 1] rows, padded with each chain's last
    for d in drafts:
        idx += [first + min(j, len(d)) for j in range(K + 1)]
        first += len(d) + 1
    p = probs[torch.tensor(idx, device=dev)].view(R, K + 1, V)
    draft_ids = torch.zeros(R, K, dtype=torch.long)
    q = torch.zeros(R, K, V, device=dev)
    for c, (d, qc) in enumerate(zip(drafts, qs)):
        if d:
            draft_ids[c, : len(d)] = torch.tensor(d)
            q[c, : len(d)] = qc[: len(d)]
    num_drafts = torch.tensor([len(d) for d in drafts], device=dev)
    rows = torch.arange(R, device=dev)
    if K:
        draft_ids = draft_ids.to(dev)
        p_d = p[:, :K].gather(-1, draft_ids[..., None])[..., 0]
        q_d = q.gather(-1, draft_ids[..., None])[..., 0]
        u = torch.rand((R, K), generator=gen, device=dev)
        # (strict: a draft p rules out, by a grammar's mask say, is never accepted, whatever u)
        ok = (u * q_d < p_d) & (torch.arange(K, device=dev)[None] < num_drafts[:, None])
        acc = ok.long().cumprod(1).sum(1)
        rejected = acc < num_drafts
        q_at = q[rows, acc.clamp(max=K - 1)] * rejected[:, None]
    else:
        acc = torch.zeros(R, dtype=torch.long, device=dev)
        q_at = torch.zeros(R, V, device=dev)
    p_at = p[rows, acc]
    residual = (p_at - q_at).clamp_min(0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q there: drawing from p is exact
    residual = torch.where(empty, p_at, residual)
    noise = torch.empty((R, V), device=dev).exponential_(generator=gen)
    bonus = (residual / noise).argmax(-1)
    return [Accepted(list(range(1, a + 1)), d[:a] + [b], a) for d, a, b in zip(drafts, acc.tolist(), bonus.tolist())]


def accept_chains_on_device(ids: torch.Tensor, picks: torch.Tensor, nxt: torch.Tensor, j: torch.Tensor,
                            req: torch.Tensor, drow: torch.Tensor, valid: torch.Tensor, first: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of B chains of up to K drafts from a verify's rows (no host sync).
    Per row: ids, picks, nxt (row of the next draft), j (index in its request), req; per request:
    drow [B*K] (rows of its drafts), valid [B*K], first (its first row). Returns the accepted count [B]
    and each row's catch-up token: draft j + 1 while j < accepted, the bonus token at j = accepted."""
    B = first.shape[0]
    following = ids.index_select(0, nxt)
    match = (following == picks).index_select(0, drow).view(B, -1) & (valid.view(B, -1) != 0)
    accepted = match.long().cumprod(1).sum(1)
    bonus = picks.index_select(0, first + accepted)
    return accepted, torch.where(j < accepted.index_select(0, req), following, bonus.index_select(0, req))


def accept_trees(tok: torch.Tensor, par: torch.Tensor, dep: torch.Tensor, picks: torch.Tensor,
                 max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``accept_greedy`` for every tree at once: tokens, parents, depths and the target's pick at each
    node [B, N]. Returns the accepted count [B], the accepted node at each depth [B, max_depth + 2]
    (column 0 the root; past the count 0, but the last column, which collects the rest) and the bonus [B]."""
    B, N = tok.shape
    dev = tok.device
    is_root = torch.arange(N, device=dev) == 0
    match = (tok == picks.gather(1, par)) | is_root  # a node's token is what the target picks at its parent
    acc = match
    for _ in range(max_depth):  # accepted: it and every ancestor match (siblings differ: one per depth)
        acc = match & acc.gather(1, par)
    accepted = (acc.long().sum(1) - 1).clamp(max=max_depth)  # (keeps a padding row's zeros in bounds)
    path = torch.zeros(B, max_depth + 2, dtype=torch.long, device=dev)
    path.scatter_(1, torch.where(acc, dep, max_depth + 1), torch.arange(N, device=dev).expand(B, N))
    last = path.gather(1, accepted[:, None])
    return accepted, path, picks.gather(1, last)[:, 0]


def compact_tree_kv(kv: torch.Tensor, tables: torch.Tensor, nc: torch.Tensor, accepted: torch.Tensor,
                    path: torch.Tensor, live: torch.Tensor, block_size: int, scratch_slot: int) -> None:
    """Move the target KV of the accepted node at depth m (position nc + node) to position nc + m in
    every layer (``kv``: the caches' slab); tables [B, W], nc/accepted/live [B], path [B, >= D + 1].
    Moves that are none write the scratch slot."""
    D = path.shape[1] - 1
    m = torch.arange(1, D + 1, device=kv.device)[None, :]
    node = path[:, 1:]
    move = (m <= accepted[:, None]) & (node != m) & (live[:, None] > 0)
    last = tables.shape[1] - 1
    scratch = torch.full_like(node, scratch_slot)
    rows = torch.arange(tables.shape[0], device=kv.device)[:, None]
    src = torch.where(move, kv_slot(tables, nc[:, None] + node, block_size, rows, last), scratch).reshape(-1)
    dst = torch.where(move, kv_slot(tables, nc[:, None] + m, block_size, rows, last), scratch).reshape(-1)
    kv.index_copy_(1, dst, kv.index_select(1, src))
