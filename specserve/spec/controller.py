"""How many tokens each request drafts next step (0 = plain decode).

``decide`` is a pure function of numbers: per-request acceptance, per-request caps, the cost
model, and the tokens the step carries anyway (one per decode plus prefill). The adaptive policy
maximises expected committed tokens per second of the step:

    goodput(k) = sum_r E_r(k_r) / (T(n_base + sum_r k_r) + D(k))

with E_r(k) = 1 + sum_{j<=k} prod_{i<=j} alpha_{r,i} (alpha: conditional acceptance at draft
position i), T the target step time vs. tokens, D the draft time (one head forward per draft
step over the requests still drafting). Candidate plans: depth cap K in 0..max and a floor lam
on the marginal acceptance prod alpha; each request drafts while its next token's marginal gain
is >= lam. A plan only replaces the current one if it is better by a margin (hysteresis).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from specserve.config import SpeculativeConfig
from specserve.spec.cost_model import CostModel

LAMBDAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class Plan:
    depth: int  # K: most tokens any request drafts
    lam: float  # marginal-acceptance floor


def plan_ks(cumacc: np.ndarray, caps: np.ndarray, plan: Plan, tree: bool = False) -> np.ndarray:
    """Draft depth per request under ``plan``: cumacc [B, K] = prod_{i<=j} alpha (non-increasing in j).

    Chains draft while the next token's marginal gain is >= lam. A tree is all or nothing: the
    full depth K for requests whose first-position acceptance is >= lam (and whose cap allows).
    """
    if plan.depth == 0 or cumacc.shape[1] == 0:
        return np.zeros(len(caps), dtype=np.int64)
    if tree:
        on = (cumacc[:, 0] >= plan.lam) & (caps > 0)
        return np.where(on, cumacc.shape[1], 0).astype(np.int64)
    ok = (cumacc[:, : plan.depth] >= plan.lam).sum(axis=1)
    return np.minimum(np.minimum(ok, caps), plan.depth)


def goodput(cumacc: np.ndarray, ks: np.ndarray, n_base: int, cost: CostModel,
            tree: tuple[int, int] | None = None) -> tuple[float, float, float]:
    """(expected tokens, predicted seconds, tokens per second) of a step where request r drafts to depth ks[r].

    tree: (nodes per tree, topk) when drafting trees: a drafted request verifies that many tokens
    and every draft step runs topk queries per request.
    """
    K = cumacc.shape[1]
    mask = np.arange(K)[None, :] < ks[:, None]
    tokens = float(len(ks) + (cumacc * mask).sum())
    depth = int(ks.max(initial=0))
    if tree is None:
        verify_tokens = int(ks.sum())
        steps = [int((ks >= j).sum()) for j in range(1, depth + 1)]
    else:
        nodes, topk = tree
        on = int((ks > 0).sum())
        verify_tokens = on * nodes
        steps = [on] + [on * topk] * (depth - 1) if on else []
    seconds = cost.step_time(n_base + verify_tokens) + cost.draft_time(steps)
    return tokens, seconds, tokens / seconds if seconds > 0 else 0.0


def decide_adaptive(cumacc: np.ndarray, caps: np.ndarray, n_base: int, cost: CostModel,
                    current: Plan | None, margin: float = 0.03,
                    tree: tuple[int, int] | None = None) -> tuple[Plan, np.ndarray]:
    """Best plan for the step (see module doc); keeps ``current`` unless beaten by ``margin``."""
    K = cumacc.shape[1]
    best_plan, best_ks = Plan(0, 0.0), np.zeros(len(caps), dtype=np.int64)
    best = goodput(cumacc, best_ks, n_base, cost, tree)[2]
    depths = [K] if tree is not None else range(1, K + 1)
    for depth in depths:
        for lam in LAMBDAS:
            p = Plan(depth, lam)
            ks = plan_ks(cumacc, caps, p, tree is not None)
            g = goodput(cumacc, ks, n_base, cost, tree)[2]
            if g > best * (1 + 1e-9):
                best_plan, best_ks, best = p, ks, g
    if current is not None and current != best_plan:
        cur_ks = plan_ks(cumacc, caps, current, tree is not None)
        if goodput(cumacc, cur_ks, n_base, cost, tree)[2] * (1 + margin) >= best:
            return current, cur_ks
    return best_plan, best_ks


@dataclass
class AcceptanceStats:
    """Conditional acceptance per draft position: accepted[j] / drafted[j]."""

    drafted: np.ndarray
    accepted: np.ndarray

    @classmethod
    def zeros(cls, k: int) -> "AcceptanceStats":
        return cls(np.zeros(k), np.zeros(k))

    def observe(self, k: int, a: int, decay: float = 1.0) -> None:
        if decay < 1.0:
            self.drafted *= decay
            self.accepted *= decay
        # position j (0-based) was reached iff all before it were accepted: j <= a
        reached = min(k, a + 1)
        self.drafted[:reached] += 1
        self.accepted[:a] += 1

    def rates(self, prior: np.ndarray | None = None, strength: float = 4.0) -> np.ndarray:
        if prior is None:
            return np.where(self.drafted > 0, self.accepted / np.maximum(self.drafted, 1e-9), 0.7)
        return (self.accepted + strength * prior) / (self.drafted + strength)


@dataclass
class SpecController:
    cfg: SpeculativeConfig
    cost: CostModel = field(default_factory=CostModel)
    overall: AcceptanceStats = field(init=False)
    per_request: dict[str, AcceptanceStats] = field(default_factory=dict)
    plan: Plan | None = None
    spec_on: bool = True  # threshold policy state
    k_histogram: Counter = field(default_factory=Counter)
    last_prediction: tuple[float, float] | None = None  # (predicted, measured) seconds of the last step
    probe_every: int = 64  # while off, let one request draft every this many decisions (keeps acceptance fresh)
    _predicted: float | None = None
    _since_spec: int = 0

    def __post_init__(self) -> None:
        self.overall = AcceptanceStats.zeros(self.cfg.num_steps)

    # -- observations ------------------------------------------------------------------------
    def observe(self, request_id: str, k: int, accepted: int) -> None:
        if k == 0:
            return
        self.overall.observe(k, accepted, decay=0.999)
        st = self.per_request.setdefault(request_id, AcceptanceStats.zeros(self.cfg.num_steps))
        st.observe(k, accepted)

    def forget(self, request_id: str) -> None:
        self.per_request.pop(request_id, None)

    def observe_step(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        if self._predicted is not None:
            self.last_prediction = (self._predicted, seconds)
        self.cost.observe_step(num_tokens, seconds)

    def observe_draft(self, batch: int, steps: int, seconds: float) -> None:
        self.cost.observe_draft(batch, steps, seconds)

    # -- decision ----------------------------------------------------------------------------
    def decide(self, requests: list, caps: list[int], num_running: int, prefill_tokens: int) -> list[int]:
        caps_a = np.asarray(caps, dtype=np.int64)
        policy = self.cfg.policy
        if policy == "static":
            ks = caps_a
        elif policy == "threshold":
            n = self.cfg.disable_batch_threshold or 0
            hyst = max(1, n // 4)
            if self.spec_on and num_running > n:
                self.spec_on = False
            elif not self.spec_on and num_running <= max(n - hyst, 0):
                self.spec_on = True
            ks = caps_a if self.spec_on else np.zeros_like(caps_a)
        else:
            prior = self.overall.rates()
            alphas = np.stack([self.per_request[r.request_id].rates(prior) if r.request_id in self.per_request
                               else prior for r in requests])
            cumacc = np.cumprod(alphas, axis=1)
            n_base = num_running + prefill_tokens
            tree = (self.cfg.resolved_num_draft_tokens - 1, self.cfg.eagle_topk) if not self.cfg.is_chain else None
            self.plan, ks = decide_adaptive(cumacc, caps_a, n_base, self.cost, self.plan, tree=tree)
            self._predicted = goodput(cumacc, ks, n_base, self.cost, tree)[1]
            if tree is not None:  # depth -> nodes of the tree to verify
                ks = np.where(ks > 0, caps_a, 0)
            self._since_spec = 0 if ks.any() else self._since_spec + 1
            if self._since_spec >= self.probe_every and caps_a.any():
                ks = ks.copy()
                i = int(np.argmax(caps_a))
                ks[i] = caps_a[i]
                self._since_spec = 0
        out = [int(k) for k in ks]
        self.k_histogram.update(out)
        return out
