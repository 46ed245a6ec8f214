"""Each arm's predicted cycle: sum_r E_r(k_r) / (T(n + P + sum_r k_r) - (T(n + P) - T(n)) + D(k)), E_r(k) =
1 + sum_{j<=k} prod_{i<=j} alpha_{r,i} (acceptance per position), T target and D draft time: the bandit's priors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specserve.speculative.policy.cost_model import CostModel

Tree = tuple[int, int]  # (nodes verified per drafting request, topk)


def arm_depths(arms: np.ndarray, cumacc: np.ndarray, caps: np.ndarray, overall: np.ndarray,
               relative: float = 0.5) -> np.ndarray:
    """[arms, B] depth per request under each uniform depth d: min(d, cap), less (down to one token)
    where the request's expected gain at a position is under ``relative`` x the mean request's at d."""
    K = cumacc.shape[1]
    d = np.minimum(arms[:, None], caps[None, :])
    if K == 0:
        return np.zeros_like(d)
    floor = relative * overall[np.clip(arms - 1, 0, K - 1)]  # [arms]
    worth = (cumacc[None, :, :] >= floor[:, None, None]).sum(axis=2)  # cumacc falls with depth: a prefix
    # at least one token: a request that drafts nothing is never measured again
    return np.where(arms[:, None] > 0, np.minimum(d, np.maximum(worth, 1)), 0)


def prefill_share(cost: CostModel, decode_tokens: int, prefill_tokens: int, num_seqs: int) -> float:
    """Seconds the prompt tokens add to a step of ``decode_tokens`` other tokens, by ``cost``."""
    if prefill_tokens <= 0:
        return 0.0
    with_prompts = cost.step_time(decode_tokens + prefill_tokens, num_seqs)
    return max(with_prompts - cost.step_time(max(decode_tokens, 1), num_seqs), 0.0)


def arm_priors(arms: np.ndarray, ks: np.ndarray, cumacc: np.ndarray, n_base: int, cost: CostModel,
               tree: Tree | None = None, prefill: int = 0) -> tuple[list[tuple[float, float]], list[float]]:
    """The cost model's (expected tokens, seconds) of a cycle under each arm's depths ks [arms, B]
    (``n_base`` decoding requests, ``prefill`` prompt tokens' own share left out), and its drafting seconds."""
    B, K = cumacc.shape
    csum = np.concatenate([np.zeros((B, 1)), np.cumsum(cumacc, axis=1)], axis=1)
    tokens = B + csum[np.arange(B)[None, :], np.minimum(ks, K)].sum(axis=1)
    depth = int(ks.max(initial=0))
    if tree is None:
        verify = ks.sum(axis=1)
        counts = (ks[:, :, None] >= np.arange(1, depth + 1)[None, None, :]).sum(axis=1)  # [arms, depth] drafting
    else:
        nodes, topk = tree
        on = (ks > 0).sum(axis=1)
        verify = on * nodes
        counts = np.where(np.arange(depth)[None, :] < ks.max(axis=1)[:, None],
                          np.where(np.arange(depth)[None, :] == 0, on[:, None], on[:, None] * topk), 0)
    draft = np.zeros(counts.shape)
    if counts.size:
        nz = counts > 0
        draft[nz] = cost.draft.predict_many(counts[nz])
    drafting = draft.sum(axis=1)
    seconds = cost.step_times(n_base + prefill + verify, B) - prefill_share(cost, n_base, prefill, B) + drafting
    return [(float(t), float(s)) for t, s in zip(tokens, seconds)], [float(d) for d in drafting]


@dataclass
class AcceptanceStats:
    """Conditional acceptance per draft position: accepted[j] / drafted[j] (plain lists: cheaper than
    numpy at one request per call)."""

    drafted: list[float]
    accepted: list[float]

    @classmethod
    def zeros(cls, k: int) -> "AcceptanceStats":
        return cls([0.0] * k, [0.0] * k)

    def observe(self, k: int, a: int) -> None:
        for j in range(min(k, a + 1)):  # position j was reached iff all before it were accepted: j <= a
            self.drafted[j] += 1
        for j in range(a):
            self.accepted[j] += 1

    prior_strength = 4.0  # pseudo-observations of the overall rate in a request's own

    def rates(self, unseen: float = 0.7, chain_strength: float = 8.0, first_strength: float = 2.0) -> list[float]:
        """Per-position rates: position 0 shrunk towards ``unseen``, each later one towards the one before it."""
        out = []
        prev = unseen
        for j, (d, a) in enumerate(zip(self.drafted, self.accepted)):
            w = first_strength if j == 0 else chain_strength
            prev = (a + w * prev) / (d + w) if d + w > 0 else prev
            out.append(prev)
        return out
