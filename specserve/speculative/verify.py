"""Lossless verification of drafted chains.

Greedy: accept the longest prefix of drafts equal to the target's argmax, then the target's
argmax at the first mismatch (or after the last draft) is the bonus token.

Sampled: speculative rejection sampling. Draft token d_j was drawn from q_j; accept it with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from norm(max(0, p_j - q_j)),
and if every draft is accepted draw the bonus from p_{k+1}. p and q are the distributions after
temperature / top-k / top-p / min-p, so the output follows exactly what plain sampling would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sampler import exponential_noise


@dataclass
class ChainVerifyResult:
    tokens: list[int]  # accepted drafts + one token from the target
    num_accepted: int


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> ChainVerifyResult:
    """target_argmax: the target's argmax at the k+1 verify rows."""
    a = 0
    while a < len(drafts) and drafts[a] == target_argmax[a]:
        a += 1
    return ChainVerifyResult(drafts[:a] + [target_argmax[a]], a)


def uniform_noise(shape: tuple[int, ...], generators: list[torch.Generator | None],
                  shared: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """U(0,1) draws, row i from generators[i] when it has one (seeded requests), else from ``shared``."""
    u = torch.rand(shape, generator=shared, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(shape[1:], generator=g, device=device)
    return u


def verify_chains_sampled(p: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, q: torch.Tensor,
                          generators: list[torch.Generator | None], shared: torch.Generator | None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for R chains at once (padded to K drafts).

    p [R, K+1, V] target distributions; drafts [R, K]; num_drafts [R]; q [R, K, V] draft distributions.
    Returns (accepted count [R], the target's token after the accepted drafts [R]).
    """
    R, K1, V = p.shape
    K = K1 - 1
    rows = torch.arange(R, device=p.device)
    if K:
        p_d = p[:, :K].gather(-1, drafts[..., None])[..., 0]
        q_d = q.gather(-1, drafts[..., None])[..., 0]
        u = uniform_noise((R, K), generators, shared, p.device)
        ok = (u * q_d <= p_d) & (torch.arange(K, device=p.device)[None] < num_drafts[:, None])
        acc = ok.long().cumprod(1).sum(1)
        rejected = acc < num_drafts
        q_at = q[rows, acc.clamp(max=K - 1)] * rejected[:, None]
    else:
        acc = torch.zeros(R, dtype=torch.long, device=p.device)
        q_at = torch.zeros(R, V, device=p.device)
    p_at = p[rows, acc]
    residual = (p_at - q_at).clamp_min(0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q there: drawing from p is exact
    residual = torch.where(empty, p_at, residual)
    noise = exponential_noise((R, V), generators, shared, p.device)
    return acc, (residual / noise).argmax(-1)
