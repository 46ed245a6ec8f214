"""How many tokens each request drafts next step (0 = plain decode): ``static``, ``threshold`` or ``adaptive``
(every request the arm its batch bucket's goodput table picks, bandit.py); interface.py is its narrow
interface.

The adaptive policy's arms, an int each: 0 plain decoding, d in 1..K (num_steps) a chain of d drafts, and in
a tree engine (eagle_topk > 1) K + 1 its whole tree (``tree_arm``)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.config import SpeculativeConfig
from specserve.speculative.policy.bandit import GoodputBandit, Prior, batch_key, bucket_batch
from specserve.speculative.policy.cost_model import CostModel, LinearCost
from specserve.speculative.policy.interface import Batch

ACCEPT_DECAY = 0.999  # per request observed: the acceptance rates' memory
REFRESH_EVERY = 64  # a bucket's predicted seconds per arm recomputed after this many of its cycles (live model)
TREE_STRENGTH = 8.0  # request-cycles of the tree's prior (the chain of its depth) in its tokens per cycle


@dataclass
class AcceptanceStats:
    """Conditional acceptance per draft position: accepted[j] / drafted[j], decayed."""

    drafted: list[float]
    accepted: list[float]

    @classmethod
    def zeros(cls, k: int) -> "AcceptanceStats":
        return cls([0.0] * k, [0.0] * k)

    def rates(self, unseen: float = 0.7, strength: float = 8.0) -> list[float]:
        """Per-position rates: position 0 shrunk towards ``unseen``, each later one towards the one before it."""
        out = []
        prev = unseen
        for d, a in zip(self.drafted, self.accepted):
            prev = (a + strength * prev) / (d + strength)
            out.append(prev)
        return out

    def tokens(self) -> list[float]:
        """Tokens a request commits per cycle at each depth 0..K: 1 + sum_j prod_{i<=j} rate_i."""
        out, p = [1.0], 1.0
        for r in self.rates():
            p *= r
            out.append(out[-1] + p)
        return out


def reached(lengths: list[int], K: int) -> list[int]:
    """Per position 0..K-1, how many of ``lengths`` pass it (O(len + K)): [2, 0, 3], K=3 -> [2, 2, 1]."""
    hist = [0] * (K + 1)
    for n in lengths:
        hist[min(n, K)] += 1
    out, run = [0] * K, 0
    for j in range(K - 1, -1, -1):
        run += hist[j + 1]
        out[j] = run
    return out


def prefill_share(cost: CostModel, decode_tokens: int, prefill_tokens: int, num_seqs: int) -> float:
    """Seconds the prompt tokens add to a step of ``decode_tokens`` other tokens, by ``cost``."""
    if prefill_tokens <= 0:
        return 0.0
    with_prompts = cost.step_time(decode_tokens + prefill_tokens, num_seqs)
    return max(with_prompts - cost.step_time(max(decode_tokens, 1), num_seqs), 0.0)


@dataclass(slots=True)
class Cycle:
    """One adaptive decision in flight: measured from the decision to the next one."""

    key: int
    arm: int
    predicted: float  # seconds of a cycle of this arm and batch, by the reference cost model
    request_ids: set[str] | None  # whose committed tokens count; None: counted already (plain decode)
    tokens: int = 0
    measured: bool = True  # False: a one-off switch, charged to exploration but not the arm's measure
    requests: int = 0  # in the decision
    prefill_seconds: float = 0.0  # the live cost model's share of prompt tokens in its steps (left out)
    exploring: bool = False
    launched_early: int = 0  # requests whose drafts were launched before the last verify's sync


@dataclass
class SpecController:
    cfg: SpeculativeConfig
    cost: CostModel = field(default_factory=CostModel)
    reference: CostModel | None = None  # the profile, frozen: the arms' predicted seconds
    bandit: GoodputBandit = field(default=None)  # type: ignore[assignment]  # (cfg.adaptive's)
    overall: AcceptanceStats = field(init=False)
    spec_on: bool = True  # threshold policy state
    k_histogram: Counter = field(default_factory=Counter)
    last_prediction: tuple[float, float] | None = None  # (predicted, measured) seconds of the last target step
    explorations: int = 0
    decisions: int = 0
    switches: int = 0  # decisions where speculation went on <-> off (explorations excluded)
    k_changes: int = 0  # decisions where some request kept from the last one got another k (same exclusions)
    cycles: int = 0  # adaptive decisions whose outcome was measured
    forced_arm: int | None = None  # every request drafts this arm (capped): the start-up calibration
    tree_drafts: bool = False  # the last decision's drafts are trees
    tree_seen: list[float] = field(default_factory=lambda: [0.0, 0.0])  # tree verifies, tokens they committed (decayed)
    # ``defer``: cycle outcomes and cost-model updates wait in ``pending`` until ``flush`` (the caller's
    # next forward launch); no decision reads them before that
    defer: bool = False
    pending: list[tuple[Callable[..., None], tuple]] = field(default_factory=list)  # (fn, args)
    _cycle: Cycle | None = None
    _exploring: bool = False  # the last quick_arm's arm is an exploration's
    _quick_key: int = 0  # bucket of the last quick_arm
    _predicted: dict[tuple[int, int], tuple[int, list[float]]] = field(default_factory=dict)  # (key, B) -> s/arm
    _last_ids: list[str] = field(default_factory=list)  # requests and k of the last counted decision
    _last_ks: list[int] = field(default_factory=list)
    _was_on: bool | None = None
    catch_up_cost: LinearCost = field(default_factory=LinearCost)  # catch-ups after plain decoding
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        self.policy = self.cfg.adaptive  # the adaptive policy's tunables
        if self.bandit is None:
            self.bandit = GoodputBandit(self.policy)
        self.overall = AcceptanceStats.zeros(self.cfg.num_steps)  # chains' (a tree's: tree_seen)
        K = self.cfg.num_steps
        self.tree_arm = None if self.cfg.is_chain else K + 1
        self._arms = list(range(K + 1)) + ([] if self.tree_arm is None else [self.tree_arm])

    # -- decisions: a table lookup -----------------------------------------------------------------
    def arms(self) -> list[int]:
        """The arms the adaptive policy chooses among, one for the whole batch (module docstring)."""
        return self._arms

    @property
    def tree_caps(self) -> bool:
        """Whether ``decide`` takes a tree's caps (Caps.cap): a tree engine's static or threshold policy;
        the adaptive policy's are a chain's (its tree arm drafts whole where one is > 0)."""
        return self.tree_arm is not None and self.cfg.policy != "adaptive"

    def drafts(self, arm: int) -> tuple[int, bool]:
        """(drafts a request takes, whether they are a tree) of ``arm``, before caps: the tree arm's are its nodes."""
        if arm == self.tree_arm:
            return self.cfg.resolved_num_draft_tokens - 1, True
        return arm, False

    def quick_arm(self, batch: int, num_running: int | None = None) -> int | None:
        """The arm every request of this batch drafts (adaptive: its bucket's table; the threshold policy:
        0 while off with ``num_running`` running requests); None: ``decide`` gives k per request (caps)."""
        if self.cfg.policy == "threshold" and num_running is not None:
            return 0 if not self._threshold_on(num_running) else None
        if self.cfg.policy != "adaptive":
            return None
        key = batch_key(batch)
        if key not in self.bandit.chosen:  # a new bucket: its row built now, once
            self.refresh(key, batch)
        arm, self._exploring = self.bandit.decide(key)
        self._quick_key = key
        self.explorations += self._exploring
        return arm

    def decide(self, batch: Batch) -> list[int]:
        """k per request of ``batch`` (the drafter's decision after the verify's sync); ``tree_drafts`` says
        whether they are trees."""
        B = len(batch.requests)
        arm = self.forced_arm if self.forced_arm is not None else self.quick_arm(B, batch.num_running)
        if arm == 0:
            self.count_off(B)
            return [0] * B
        if arm is not None:
            return self.uniform(batch.requests, arm, batch.caps)
        self.tree_drafts = self.tree_arm is not None  # (static, threshold: the engine's kind, capped as it)
        ks = [0] * B if self.cfg.policy == "threshold" and not self.spec_on else list(batch.caps)
        self._count([r.request_id for r in batch.requests], ks, False)
        return ks

    def count_off(self, batch: int) -> None:
        """A decision of k = 0 for the whole batch (adaptive: still measured, one token a request)."""
        exploring, self._exploring = self._exploring, False
        if self.cfg.policy == "adaptive":
            self._cycle = Cycle(self._quick_key, 0, self._predicted_s(self._quick_key, batch, 0), None,
                                tokens=batch, requests=batch, exploring=exploring)
        self.decisions += 1
        self.k_histogram[0] += batch
        if exploring:  # (explorations are no switches)
            return
        if self._was_on:
            self.switches += 1
        self._was_on = False

    def uniform(self, requests: list, arm: int, caps: list[int]) -> list[int]:
        """Every request drafts ``arm``, counted as a decision: a chain of min(d, its cap), or the whole tree
        where its cap is > 0 (``caps``: a chain's, Caps.cap)."""
        exploring, self._exploring = self._exploring, False
        k, self.tree_drafts = self.drafts(arm)
        ks = [k if c > 0 else 0 for c in caps] if self.tree_drafts else [min(k, c) for c in caps]
        key, B = self._quick_key, len(requests)
        ids = [r.request_id for r in requests]
        self._cycle = Cycle(key, arm, self._predicted_s(key, B, arm), set(ids), requests=B, exploring=exploring)
        self._count(ids, ks, exploring)
        return ks

    def _threshold_on(self, num_running: int) -> bool:
        """The threshold policy's state: off above N running requests, on again at N - N/4 or fewer."""
        n = self.cfg.disable_batch_threshold or 0
        hyst = max(1, n // 4)
        if self.spec_on and num_running > n:
            self.spec_on = False
        elif not self.spec_on and num_running <= max(n - hyst, 0):
            self.spec_on = True
        return self.spec_on

    # -- the table, rebuilt off the hot path -----------------------------------------------------------
    def priors(self, key: int, batch: int) -> dict[int, Prior]:
        """(tokens a request commits per cycle, predicted seconds of a cycle of ``batch`` requests) per arm."""
        tokens = self.overall.tokens()
        if self.tree_arm is not None:
            tokens.append(self.tree_tokens(tokens[-1]))
        return {arm: (tokens[arm], self._predicted_s(key, batch, arm)) for arm in self.arms()}

    def tree_tokens(self, chain: float) -> float:
        """Tokens a request commits per tree verify: those seen, shrunk towards ``chain`` (the chain of the
        tree's depth: the tree holds about that chain, and more) by TREE_STRENGTH verifies."""
        n, tokens = self.tree_seen
        return (tokens + TREE_STRENGTH * chain) / (n + TREE_STRENGTH)

    def refresh(self, key: int, batch: int) -> None:
        self.bandit.refresh(key, self.priors(key, batch), batch)

    def _predicted_s(self, key: int, batch: int, arm: int) -> float:
        """The reference's seconds of a cycle of ``batch`` requests drafting ``arm`` (kept per bucket and
        batch; a live model's recomputed every REFRESH_EVERY asks)."""
        got = self._predicted.get((key, batch))
        if got is None or (got[0] >= REFRESH_EVERY and self.reference is self.cost):  # (reference set with got)
            ref, K = self._reference(), self.cfg.num_steps
            out = []
            for a in range(len(self._arms)):  # (arms are 0..len - 1)
                k, tree = self.drafts(a)
                s = ref.step_time(batch + k * batch, batch)
                if k:  # draft forwards: a chain's B rows each; a tree's B, then B x topk (K steps)
                    wide, steps = (batch * self.cfg.eagle_topk, K) if tree else (batch, k)
                    s += ref.draft.predict(batch) + (steps - 1) * ref.draft.predict(wide)
                out.append(s)
            got = [0, out]
            if len(self._predicted) >= 4096:
                self._predicted.clear()
            self._predicted[(key, batch)] = got
        got[0] += 1
        return got[1][arm]

    def _reference(self) -> CostModel:
        if self.reference is None:
            self.reference = CostModel.from_json(self.cost.to_json()) if self.cost.target.profile else self.cost
        return self.reference

    def seed(self, batch: int, arm: int, seconds: float, cycles: float = 2.0) -> None:
        """Steps of ``batch`` requests all drafting ``arm`` took ``seconds`` each (timed before serving)."""
        self.bandit.seed(batch_key(batch), arm, seconds, batch, cycles)

    # -- observations ------------------------------------------------------------------------------
    def observe_many(self, request_ids: list[str], ks: list[int], accepted: list[int],
                     trees: list[bool] | None = None) -> None:
        """Requests ``request_ids`` verified ``ks`` drafts (``trees``: which were trees, of ``ks`` their depth)
        and accepted ``accepted`` (chains' rates and trees' tokens decay by ACCEPT_DECAY a request)."""
        c = self._cycle
        if c is not None and c.request_ids is not None:
            mine = [a for rid, a in zip(request_ids, accepted) if rid in c.request_ids]
            c.tokens += sum(mine) + len(mine)
        if trees is not None and any(trees):
            got = [a + 1 for k, a, t in zip(ks, accepted, trees) if t and k]
            f = ACCEPT_DECAY ** len(got)
            self.tree_seen = [self.tree_seen[0] * f + len(got), self.tree_seen[1] * f + sum(got)]
            ks = [0 if t else k for k, t in zip(ks, trees)]
        ov = self.overall
        K = len(ov.drafted)
        drafted = [(k, a) for k, a in zip(ks, accepted) if k]
        n = len(drafted)
        if n:  # position j was reached iff all before it were accepted
            dr = reached([min(k, a + 1) for k, a in drafted], K)
            ac = reached([a for _, a in drafted], K)
            f = ACCEPT_DECAY**n
            ov.drafted = [x * f + d for x, d in zip(ov.drafted, dr)]
            ov.accepted = [x * f + d for x, d in zip(ov.accepted, ac)]

    @property
    def cycle_open(self) -> bool:
        """A cycle whose requests' accepted counts are still to be observed."""
        return self._cycle is not None and self._cycle.request_ids is not None

    def note_launched_early(self, n: int) -> None:
        """``n`` requests of the cycle just decided took drafts launched before the sync (observability)."""
        if self._cycle is not None:
            self._cycle.launched_early = n

    def skip_cycle(self) -> None:
        """The current cycle is not typical of its arm (a one-off cost of switching: drafting that catches
        the draft KV up over plain steps, plain decoding not yet launched ahead): left out of its measure."""
        if self._cycle is not None:
            self._cycle.measured = False

    def detach_cycle(self) -> Cycle | None:
        """The cycle in flight, taken out so that a new decision can start before it is ended."""
        c, self._cycle = self._cycle, None
        return c

    def _later(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)`` now, or at the next ``flush`` when deferring."""
        if self.defer:
            self.pending.append((fn, args))
        else:
            fn(*args)

    def flush(self) -> None:
        """Run the bookkeeping ``defer`` held back, in the order it came."""
        todo, self.pending = self.pending, []
        for fn, args in todo:
            fn(*args)

    def finish_cycle(self, c: Cycle | None, seconds: float) -> None:
        """The wall time of a detached cycle (None: nothing to measure); its bucket's row rebuilt after."""
        if c is None or c.tokens <= 0:
            return
        self._later(self._finish_cycle, c, seconds)

    def _finish_cycle(self, c: Cycle, seconds: float) -> None:
        measured = c.measured and c.prefill_seconds <= self.policy.prefill_share_limit * seconds
        seconds = max(seconds - c.prefill_seconds, 0.2 * seconds)
        if not measured:
            self.bandit.charge(c.key, c.arm, c.tokens, seconds, c.requests, c.exploring)
        else:
            self.bandit.observe(c.key, c.arm, c.predicted, c.tokens, seconds, c.requests)
            self.cycles += 1
        if self.bandit.due(c.key, c.arm):
            self.refresh(c.key, c.requests)

    def observe_step(self, num_tokens: int, num_seqs: int, seconds: float, prefill_tokens: int = 0,
                     decode_rows: int = 0, own_time: bool = True) -> None:
        """A target step of ``num_tokens`` (``prefill_tokens`` of them prompt, ``decode_rows`` sampling,
        the rest drafts) took ``seconds``; ``own_time`` False: with device work queued before it."""
        if not own_time and (prefill_tokens <= 0 or self._cycle is None):
            return  # nothing to learn (_observe_step)
        # the cycle in flight now, whenever this runs
        self._later(self._observe_step, self._cycle, num_tokens, num_seqs, seconds, prefill_tokens, decode_rows,
                    own_time)

    def _observe_step(self, c: Cycle | None, num_tokens: int, num_seqs: int, seconds: float, prefill_tokens: int,
                      decode_rows: int, own_time: bool = True) -> None:
        if c is not None:
            c.prefill_seconds += prefill_share(self.cost, decode_rows, prefill_tokens, num_seqs)
        if not own_time:
            return
        pred = self.cost.observe_step(num_tokens, seconds, num_seqs)
        if pred is not None:
            self.last_prediction = (pred, seconds)

    def observe_draft(self, batch: int, steps: int, seconds: float) -> None:
        self._later(lambda: self.cost.observe_draft(batch, steps, seconds))  # self.cost as it is when this runs

    def catch_up_seconds(self, tokens: int) -> float:
        """Predicted seconds of a catch-up over ``tokens``: fitted on past catch-ups, else one head forward
        over that many rows by the reference profile."""
        if tokens <= 0:
            return 0.0
        s = self.catch_up_cost.predict(tokens)
        return s if s is not None else self._reference().draft.predict(tokens)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A switch's catch-up (after plain decoding) over ``tokens`` took ``seconds``."""
        self.catch_up_cost.observe(tokens, seconds)

    def _count(self, ids: list[str], ks: list[int], exploring: bool) -> None:
        """A decision of ``ks`` for requests ``ids``: the histogram, switches and k changes."""
        self.decisions += 1
        self.k_histogram.update(ks)
        if exploring:
            return
        on = any(ks)
        if self._was_on is not None and on != self._was_on:
            self.switches += 1
        self._was_on = on
        if ids == self._last_ids:  # the usual case: the same batch as last step
            changed = ks != self._last_ks
        else:
            last = dict(zip(self._last_ids, self._last_ks))
            changed = any(last.get(rid, k) != k for rid, k in zip(ids, ks))
        self.k_changes += changed
        self._last_ids, self._last_ks = ids, ks

    def snapshot(self) -> dict:
        """Observable state: decisions, switches, k histogram, the goodput tables, cost model (what ``defer``
        held back included: call it from the thread that steps the engine)."""
        self.flush()
        n = sum(self.k_histogram.values())
        f = self.catch_up_cost.fit()
        return {"policy": self.cfg.policy, "decisions": self.decisions, "switches": self.switches,
                "k_changes": self.k_changes, "explorations": self.explorations, "cycles": self.cycles,
                "k_histogram": {int(k): v for k, v in sorted(self.k_histogram.items())},
                "mean_k": sum(k * v for k, v in self.k_histogram.items()) / n if n else None,
                "acceptance": [round(float(x), 4) for x in self.overall.rates()],
                "tree_tokens": None if self.tree_arm is None else round(self.tree_tokens(self.overall.tokens()[-1]), 4),
                "measured_goodput": self.bandit.summary(), "exploration_budget": self.bandit.budget_summary(),
                "pick_changes": self.bandit.pick_changes(),
                "catch_up_fit": None if f is None else {"fixed_ms": round(f[0] * 1e3, 4),
                                                        "us_per_token": round(f[1] * 1e6, 4)},
                "last_prediction": self.last_prediction, "cost": self.cost.summary(),
                "buckets": [bucket_batch(k) for k in sorted(self.bandit.chosen)]}
