"""How many tokens each request drafts next step (0 = plain decode).

``decide_adaptive`` is a pure function of numbers: per-request acceptance, per-request caps, the
cost model, and the tokens the step carries anyway (one per decode plus prefill). It maximises
expected committed tokens per second of the step:

    goodput(k) = sum_r E_r(k_r) / (T(n_base + sum_r k_r) + D(k))

with E_r(k) = 1 + sum_{j<=k} prod_{i<=j} alpha_{r,i} (alpha: conditional acceptance at draft
position i), T the measured target step time vs. tokens in the step (a table, not a smooth fit:
on a CPU it can be flat for 1-3 tokens and jump at 4), and D the draft time (one head forward
per draft step over the requests still drafting).

Search: for a depth cap d (1..K) the best set of S draft tokens is the S largest marginal gains
prod alpha (each request's are non-increasing in position, so any top-S is a valid per-request
prefix). Every (d, S) is evaluated against the curve, so the step total can stop right before a
jump. The previous per-request k is kept unless the best plan beats it by ``margin``
(hysteresis: fewer k switches, no flapping between near-equal plans), but a plan that drafts is
never kept once it is predicted slower than drafting nothing.

The cost model learns only the token counts the engine actually runs, so every ``explore_every``
decisions the step runs another plausible total instead (``explore_chain``: the least-measured
bucket among the totals predicted within 5 % of the best goodput, and no drafting), and while
speculation is off one request drafts in full every ``probe_every`` decisions, keeping the
acceptance of every position current.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from specserve.config import SpeculativeConfig
from specserve.spec.cost_model import CostModel, bucket

Tree = tuple[int, int]  # (nodes verified per drafting request, topk)


def goodput(cumacc: np.ndarray, ks: np.ndarray, n_base: int, cost: CostModel,
            tree: Tree | None = None) -> tuple[float, float, float]:
    """(expected tokens, predicted seconds, tokens per second) of a step where request r drafts to depth ks[r].

    tree: (nodes per tree, topk) when drafting trees: a drafted request verifies that many tokens
    and every draft step after the first runs topk queries per request.
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
    seconds = cost.step_time(n_base + verify_tokens, len(ks)) + cost.draft_time(steps)
    return tokens, seconds, tokens / seconds if seconds > 0 else 0.0


@dataclass
class ChainCurve:
    """Predicted goodput of drafting the S best tokens (S = 0..M) under a depth cap."""

    depth: int
    order: np.ndarray  # flat indices r * depth + j of the draft tokens, best marginal gain first
    goodput: np.ndarray  # [M + 1]

    def ks(self, S: int, B: int) -> np.ndarray:
        return np.bincount(self.order[:S] // self.depth, minlength=B).astype(np.int64)


def chain_curves(cumacc: np.ndarray, caps: np.ndarray, n_base: int, cost: CostModel) -> list[ChainCurve]:
    B, K = cumacc.shape
    K = min(K, int(caps.max(initial=0)))
    # every step time and draft forward time the search can need, predicted once
    step = cost.step_times(n_base + np.arange(B * K + 1), B)
    draft_of = np.concatenate([[0.0], cost.draft.predict_many(np.arange(1, B + 1))])
    g0 = B / step[0] if step[0] > 0 else 0.0
    curves = []
    for d in range(1, K + 1):
        vals = np.where(np.arange(d)[None, :] < caps[:, None], cumacc[:, :d], -1.0).ravel()
        order = np.argsort(-vals, kind="stable")
        order = order[vals[order] >= 0]
        tokens = B + np.cumsum(vals[order])
        # requests drafting at draft step j once the first S tokens are taken: [d, S]
        counts = np.cumsum((order % d)[None, :] == np.arange(d)[:, None], axis=1)
        g = tokens / (step[1 : len(order) + 1] + draft_of[counts].sum(axis=0))
        curves.append(ChainCurve(d, order, np.concatenate([[g0], g])))
    return curves


def _best_chain(cumacc: np.ndarray, caps: np.ndarray, n_base: int, cost: CostModel) -> tuple[np.ndarray, float]:
    B = cumacc.shape[0]
    best_ks = np.zeros(B, dtype=np.int64)
    curves = chain_curves(cumacc, caps, n_base, cost)
    best = float(curves[0].goodput[0]) if curves else 0.0
    for c in curves:
        i = int(np.argmax(c.goodput))
        if c.goodput[i] > best * (1 + 1e-9):
            best, best_ks = float(c.goodput[i]), c.ks(i, B)
    return best_ks, best


def explore_chain(cumacc: np.ndarray, caps: np.ndarray, n_base: int, cost: CostModel, planned: np.ndarray,
                  plausible: float = 0.95) -> tuple[np.ndarray, int] | None:
    """An exploratory plan and how often its bucket was measured: among the step totals whose
    predicted goodput is at least ``plausible`` x the best (and no drafting at all), the one whose
    target-time bucket has the fewest measurements (ties: nearest to the plan), the plan's own
    bucket excluded. None when there is nothing else worth measuring."""
    curves = chain_curves(cumacc, caps, n_base, cost)
    if not curves:
        return None
    c = curves[-1]  # the deepest cap: every total S is reachable
    g = c.goodput
    S_plan = int(planned.sum())
    own = bucket(n_base + S_plan)
    best_key, best_S = None, None
    # no drafting (S = 0) is always worth measuring: it is the reference every plan is judged against
    for S in sorted({0, *np.flatnonzero(g >= plausible * g.max()).tolist()}):
        b = bucket(n_base + int(S))
        if b == own:
            continue
        key = (cost.samples_at(b, len(caps)), abs(int(S) - S_plan))
        if best_key is None or key < best_key:
            best_key, best_S = key, int(S)
    return None if best_S is None else (c.ks(best_S, cumacc.shape[0]), best_key[0])


def _best_tree(cumacc: np.ndarray, caps: np.ndarray, n_base: int, cost: CostModel, tree: Tree) -> np.ndarray:
    """Trees are all or nothing per request: the m requests with the best first-position acceptance."""
    B, K = cumacc.shape
    nodes, topk = tree
    order = np.argsort(-cumacc[:, 0], kind="stable")
    order = order[caps[order] > 0]
    best_m, best = 0, goodput(cumacc, np.zeros(B, dtype=np.int64), n_base, cost, tree)[2]
    if len(order):
        m = np.arange(1, len(order) + 1)
        tokens = B + np.cumsum(cumacc[order].sum(axis=1))
        draft = cost.draft.predict_many(m) + (K - 1) * cost.draft.predict_many(m * topk)
        g = tokens / (cost.step_times(n_base + m * nodes, B) + draft)
        i = int(np.argmax(g))
        if g[i] > best * (1 + 1e-9):
            best_m = i + 1
    ks = np.zeros(B, dtype=np.int64)
    ks[order[:best_m]] = K
    return ks


def decide_adaptive(cumacc: np.ndarray, caps: np.ndarray, n_base: int, cost: CostModel,
                    previous: np.ndarray | None = None, margin: float = 0.03,
                    tree: Tree | None = None) -> np.ndarray:
    """Draft depth per request for the best expected tokens per second (see module doc).

    previous: each request's depth last step (-1: new request); kept, capped, unless the best plan
    is better by ``margin``. Tree mode returns depth K (the caller maps it to nodes) or 0.
    """
    caps = np.asarray(caps, dtype=np.int64)
    if cumacc.shape[1] == 0 or len(caps) == 0:
        return np.zeros(len(caps), dtype=np.int64)
    if tree is None:
        best_ks = _best_chain(cumacc, caps, n_base, cost)[0]
    else:
        best_ks = _best_tree(cumacc, caps, n_base, cost, tree)
    if previous is None or margin <= 0:
        return best_ks
    prev = np.asarray(previous, dtype=np.int64)
    kept = np.minimum(prev, caps) if tree is None else np.where(caps > 0, prev, 0)
    cur = np.where(prev < 0, best_ks, kept)
    if (cur == best_ks).all():
        return best_ks
    g_best = goodput(cumacc, best_ks, n_base, cost, tree)[2]
    g_cur = goodput(cumacc, cur, n_base, cost, tree)[2]
    if cur.any() and g_cur < goodput(cumacc, np.zeros_like(cur), n_base, cost, tree)[2]:
        # the band is one-sided: drafting starts only once it beats the current plan by margin, and
        # stops as soon as it is predicted slower than plain decode (never "kept" at a loss)
        return best_ks
    return cur if g_cur * (1 + margin) >= g_best else best_ks


@dataclass
class AcceptanceStats:
    """Conditional acceptance per draft position: accepted[j] / drafted[j] (plain lists: updated
    per request per step, where small numpy operations would cost more than the step's decision)."""

    drafted: list[float]
    accepted: list[float]

    @classmethod
    def zeros(cls, k: int) -> "AcceptanceStats":
        return cls([0.0] * k, [0.0] * k)

    def observe(self, k: int, a: int, decay: float = 1.0) -> None:
        if decay < 1.0:
            self.drafted = [x * decay for x in self.drafted]
            self.accepted = [x * decay for x in self.accepted]
        # position j (0-based) was reached iff all before it were accepted: j <= a
        for j in range(min(k, a + 1)):
            self.drafted[j] += 1
        for j in range(a):
            self.accepted[j] += 1

    def rates(self, prior: list[float] | np.ndarray | None = None, strength: float = 4.0,
              unseen: float = 0.7, chain_strength: float = 8.0, first_strength: float = 2.0) -> list[float]:
        """Per-position rates; with ``prior``, shrunk towards it by ``strength`` pseudo-observations.

        Without a prior, the first position is shrunk towards ``unseen`` (optimistic, so drafting
        gets tried) by ``first_strength`` pseudo-observations, and each later one towards the rate
        of the one before it by ``chain_strength``: a deep position drafted twice and rejected
        twice is not taken for a rate of 0.
        """
        if prior is not None:
            return [(a + strength * p) / (d + strength) for a, d, p in zip(self.accepted, self.drafted, prior)]
        out = []
        prev = unseen
        for j, (d, a) in enumerate(zip(self.drafted, self.accepted)):
            w = first_strength if j == 0 else chain_strength
            prev = (a + w * prev) / (d + w) if d + w > 0 else prev
            out.append(prev)
        return out


@dataclass
class SpecController:
    cfg: SpeculativeConfig
    cost: CostModel = field(default_factory=CostModel)
    overall: AcceptanceStats = field(init=False)
    per_request: dict[str, AcceptanceStats] = field(default_factory=dict)
    margin: float = 0.03  # hysteresis: a new plan must beat the current one by this fraction
    optimism: float = 0.5  # standard errors added to little-measured acceptance rates
    spec_on: bool = True  # threshold policy state
    k_histogram: Counter = field(default_factory=Counter)
    last_prediction: tuple[float, float] | None = None  # (predicted, measured) seconds of the last target step
    probe_every: int = 64  # while off, let one request draft every this many decisions (keeps acceptance fresh)
    explore_every: int = 16  # every this many decisions one request drafts one token more or less (0: never)
    explorations: int = 0
    decisions: int = 0
    switches: int = 0  # decisions where speculation went on <-> off (probes and explorations excluded)
    k_changes: int = 0  # decisions where some request kept from the last one got another k (same exclusions)
    probes: int = 0
    _last_k: dict[str, int] = field(default_factory=dict)  # adaptive: depth per request, last decision
    _last_out: dict[str, int] = field(default_factory=dict)
    _was_on: bool | None = None
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
        self._last_k.pop(request_id, None)

    def observe_step(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        pred = self.cost.observe_step(num_tokens, seconds, num_seqs)
        if pred is not None:
            self.last_prediction = (pred, seconds)

    def observe_draft(self, batch: int, steps: int, seconds: float) -> None:
        self.cost.observe_draft(batch, steps, seconds)

    # -- decision ----------------------------------------------------------------------------
    def decide(self, requests: list, caps: list[int], num_running: int, prefill_tokens: int) -> list[int]:
        caps_a = np.asarray(caps, dtype=np.int64)
        policy = self.cfg.policy
        probe = False
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
            ks, probe = self._decide_adaptive(requests, caps_a, num_running + prefill_tokens)
        out = [int(k) for k in ks]
        self._count(requests, out, probe)
        return out

    def _decide_adaptive(self, requests: list, caps: np.ndarray, n_base: int) -> tuple[np.ndarray, bool]:
        prior = self.overall.rates()
        alphas = np.array([self.per_request[r.request_id].rates(prior) if r.request_id in self.per_request
                           else prior for r in requests], dtype=float)
        # optimism where the head's acceptance at a position is little measured (a position that is
        # rarely drafted would otherwise keep an unlucky early estimate): + optimism x standard error
        a = np.asarray(prior)
        bonus = self.optimism * np.sqrt(a * (1 - a) / (np.asarray(self.overall.drafted) + 1))
        alphas = np.minimum(alphas + bonus, 1.0)
        cumacc = np.cumprod(alphas, axis=1)
        tree = (self.cfg.resolved_num_draft_tokens - 1, self.cfg.eagle_topk) if not self.cfg.is_chain else None
        prev = np.array([self._last_k.get(r.request_id, -1) for r in requests], dtype=np.int64)
        ks = decide_adaptive(cumacc, caps, n_base, self.cost, prev, self.margin, tree)
        self._last_k = {r.request_id: int(k) for r, k in zip(requests, ks)}
        if len(self.per_request) > 4 * len(requests) + 256:  # finished requests' stats
            self.per_request = {r.request_id: self.per_request[r.request_id] for r in requests
                                if r.request_id in self.per_request}
        if tree is not None:  # depth -> nodes of the tree to verify
            ks = np.where(ks > 0, caps, 0)
        self._since_spec = 0 if ks.any() else self._since_spec + 1
        on = np.flatnonzero(caps > 0)
        if self._since_spec >= self.probe_every and len(on):
            # off for a while: one request drafts in full, so acceptance at every depth stays current
            ks = ks.copy()
            i = int(on[self.probes % len(on)])  # rotate over requests
            ks[i] = caps[i]
            self._since_spec = 0
            self.probes += 1
            return ks, True
        if tree is None and self.explore_every and self.decisions % self.explore_every == self.explore_every - 1:
            alt = explore_chain(cumacc, caps, n_base, self.cost, ks)
            # buckets measured often enough already: refresh them at a quarter of the rate
            if alt is not None and (alt[1] < self.cost.target.min_samples
                                    or self.decisions % (4 * self.explore_every) == 4 * self.explore_every - 1):
                self.explorations += 1
                return alt[0], True
        return ks, False

    def _count(self, requests: list, ks: list[int], probe: bool) -> None:
        self.decisions += 1
        self.k_histogram.update(ks)
        if probe:
            return
        on = any(ks)
        if self._was_on is not None and on != self._was_on:
            self.switches += 1
        self._was_on = on
        out = {r.request_id: k for r, k in zip(requests, ks)}
        if any(self._last_out.get(rid, k) != k for rid, k in out.items()):
            self.k_changes += 1
        self._last_out = out

    def snapshot(self) -> dict:
        """Observable state: decisions, switches, k histogram, last prediction, cost model summary."""
        n = sum(self.k_histogram.values())
        return {"policy": self.cfg.policy, "decisions": self.decisions, "switches": self.switches,
                "k_changes": self.k_changes, "probes": self.probes, "explorations": self.explorations,
                "k_histogram": {int(k): v for k, v in sorted(self.k_histogram.items())},
                "mean_k": sum(k * v for k, v in self.k_histogram.items()) / n if n else None,
                "acceptance": [round(float(x), 4) for x in self.overall.rates()],
                "last_prediction": self.last_prediction, "cost": self.cost.summary()}
