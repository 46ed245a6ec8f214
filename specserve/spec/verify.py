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

from specserve.engine.sampler import SamplingBatch, exponential_noise, processed_probs


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


def verify_sampled(target_logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                   sb: SamplingBatch, shared: torch.Generator | None) -> ChainVerifyResult:
    """target_logits [k+1, V]; draft_probs [k, V] (q_j over the target vocab); sb has k+1 rows of one request."""
    k = len(drafts)
    p = processed_probs(target_logits, sb)  # [k+1, V]
    gen = sb.generators[0] or shared
    a = k
    if k:
        d = torch.tensor(drafts, device=p.device)
        rows = torch.arange(k, device=p.device)
        p_d = p[rows, d]
        q_d = draft_probs[rows, d]
        u = torch.rand(k, generator=gen, device=p.device)
        reject = (u * q_d > p_d).nonzero()
        if len(reject):
            a = int(reject[0, 0])
    if a < k:
        residual = (p[a] - draft_probs[a]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q: any draw from p is exact
            residual = p[a]
        dist = residual[None]
    else:
        dist = p[k : k + 1]
    q = exponential_noise((1, dist.shape[-1]), [gen], shared, p.device)
    tok = int((dist / q).argmax(-1))
    return ChainVerifyResult(drafts[:a] + [tok], a)
