"""Per batch bucket, a table: each depth's goodput (tokens a request commits per cycle over measured seconds per
request-cycle: the batch's tokens a second; the cost model's prediction as prior), the pick and the next depth
worth exploring. ``refresh`` rebuilds a bucket's row after its cycles are measured (off the hot path); ``decide``
reads it (docs/decisions.md, "Adaptive policy"; the fields: AdaptivePolicyConfig)."""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field

from specserve.config import AdaptivePolicyConfig

ROW_CYCLES = 8  # a bucket's row is rebuilt after this many cycles of its pick (after any other arm's at once)
PICK_LOG = 256  # the latest pick changes kept for reports (``pick_changes``)


@functools.lru_cache(maxsize=4096)
def batch_key(batch: int) -> int:
    """Half-octave buckets centred on powers of two: 31 and 32 requests share one."""
    return int(round(2 * math.log2(max(batch, 1))))


def bucket_batch(key: int) -> int:
    """The batch size at the centre of bucket ``key`` (``batch_key``'s inverse, for reports)."""
    return round(2 ** (key / 2))


@dataclass(slots=True)
class ArmStats:
    """Decayed sums over one arm's served cycles in one bucket; start-up seeds beside them."""

    n: float = 0.0
    requests: float = 0.0  # request-cycles
    seconds: float = 0.0  # measured
    predicted: float = 0.0  # by the cost model, for the cycles as they ran
    seed_n: float = 0.0  # start-up pseudo-cycles left: each served cycle displaces one
    seed_spr: float = 0.0  # ... their seconds per request-cycle

    def fade(self, f: float) -> None:
        self.n *= f
        self.requests *= f
        self.seconds *= f
        self.predicted *= f


Prior = tuple[float, float]  # tokens a request commits per cycle, predicted seconds of a cycle of the batch
_NONE = ArmStats()  # what an arm without cycles reads as (never added to)
_EMPTY: dict = {}  # what a bucket without a row reads as (never added to)


@dataclass(slots=True)
class PickRun:
    """Cycles of a bucket's pick after its first, summed as ``observe`` and ``_account`` would have added them
    (each sum decayed once a cycle) and added in one go (``GoodputBandit._fold``) before anything reads them."""

    key: int
    arm: int
    requests: int
    cap: float  # the most seconds a cycle counts (clip)
    f: float  # the stats' decay per cycle
    g: float  # the budget's
    k: int = 0
    n: float = 0.0
    seconds: float = 0.0
    predicted: float = 0.0
    elapsed: float = 0.0


@dataclass
class GoodputBandit:
    cfg: AdaptivePolicyConfig = field(default_factory=AdaptivePolicyConfig)
    stats: dict[int, dict[int, ArmStats]] = field(default_factory=dict)  # bucket -> arm -> sums
    chosen: dict[int, int] = field(default_factory=dict)  # bucket -> the pick
    explore: dict[int, int | None] = field(default_factory=dict)  # bucket -> its next exploration (None: none)
    goodput: dict[int, dict[int, float]] = field(default_factory=dict)  # bucket -> arm -> the batch's tok/s
    spr: dict[int, dict[int, float]] = field(default_factory=dict)  # bucket -> arm -> estimated s per request-cycle
    visits: dict[int, int] = field(default_factory=dict)  # decisions per bucket
    spent: dict[int, float] = field(default_factory=dict)  # bucket -> seconds explorations lost (decayed)
    elapsed: dict[int, float] = field(default_factory=dict)  # bucket -> seconds of its cycles (decayed)
    _last_loss: dict[int, float] = field(default_factory=dict)  # bucket -> seconds its last exploration lost
    _again: dict[int, int] = field(default_factory=dict)  # bucket -> arm explored once so far
    _rerun: set[int] = field(default_factory=set)  # buckets whose exploration ran plain decoding again (``charge``)
    _fresh: dict[int, int] = field(default_factory=dict)  # bucket -> cycles of its pick since its row was built
    _run: PickRun | None = None  # the pick's latest cycles, not yet in ``stats``, ``elapsed`` and ``spent``
    # (turn, bucket, old pick, new pick, their goodput, tokens a request-cycle and served cycles): the latest
    changes: deque = field(default_factory=lambda: deque(maxlen=PICK_LOG))

    @property
    def turns(self) -> int:
        """Decisions so far, all buckets."""
        return sum(self.visits.values())

    # -- the hot path: a lookup ------------------------------------------------------------------
    def decide(self, key: int) -> tuple[int, bool]:
        """(arm, exploring) for the next cycle in bucket ``key`` (``refresh``ed at least once): the pick, or on
        an exploration turn within the budget the arm the table marks worth exploring (two cycles)."""
        c = self.cfg
        v = self.visits.get(key, 0)
        self.visits[key] = v + 1
        again = self._again.pop(key, None)
        if again is not None:
            return again, True
        every = 0 if not c.explore_every else c.warm_every if v < c.warm_visits else c.explore_every
        if not every or v % every != every - 1:  # no exploration turn: the pick
            return self.chosen[key], False
        alt = self.explore.get(key)
        # unbudgeted: plain decoding under a drafting pick (the floor), and a bucket's warm-up out of a
        # drafting pick (its first cycles may be a pause's)
        free = self.chosen[key] != 0 and (alt == 0 or v < c.warm_visits)
        if alt is not None and (free or self._within_budget(key)):
            self._again[key] = alt
            self._rerun.discard(key)
            self._last_loss[key] = 0.0
            return alt, True
        return self.chosen[key], False

    def _within_budget(self, key: int) -> bool:
        """Whether an exploration losing what the last one lost fits bucket ``key``'s budget."""
        self._fold()
        expected = self._last_loss.get(key, 0.0)
        return self.spent.get(key, 0.0) + expected <= self.cfg.explore_budget * self.elapsed.get(key, 0.0)

    # -- off the hot path: the table ---------------------------------------------------------------
    def estimates(self, key: int, priors: dict[int, Prior], batch: int) -> dict[int, tuple[float, float]]:
        """(goodput, its standard error) per arm of ``priors`` for cycles of ``batch`` requests."""
        self._fold()
        c = self.cfg
        arms = self.stats.get(key, {})
        borrowed = self._drafting_excess(arms, batch)
        plain = arms.get(0) or _NONE
        out: dict[int, tuple[float, float]] = {}
        spr: dict[int, float] = {}
        for arm in sorted(priors):
            tokens, psec = priors[arm]
            st = arms.get(arm) or _NONE
            if st.seed_n > 1e-9:  # timed at start-up: the prior is the measure
                prior, w = st.seed_spr, st.seed_n
            else:  # predicted, plus what this arm's cycles (or, unserved, the drafting ones') exceed it by
                own = (st.seconds - st.predicted) / st.requests if st.requests > 1e-9 else None
                excess = own if own is not None else (borrowed if arm else 0.0)
                prior, w = max(psec / batch + excess, 0.1 * psec / batch), 1.0
            s = (st.seconds + w * batch * prior) / (st.requests + w * batch)
            if arm and plain.n >= c.cap_cycles:  # a drafting cycle does all a plain one does, and more
                s = max(s, spr[0]) if 0 in spr else s
            spr[arm] = s
            g = tokens / s if s > 0 else 0.0
            out[arm] = (g, g * c.default_cv / math.sqrt(st.n + st.seed_n + 0.1))  # (a prior alone: 3x a cycle's)
        self.spr[key] = spr
        return out

    def _drafting_excess(self, arms: dict[int, ArmStats], batch: int) -> float:
        """Measured minus predicted seconds per request-cycle of drafting arms: this bucket's, else every one's
        (shrunk towards none by two cycles of ``batch`` requests: one slow cycle lends a third of its excess)."""
        for pool in ([arms], self.stats.values()):
            num = den = 0.0
            for st in (st for bucket in pool for a, st in bucket.items() if a):
                num += st.seconds - st.predicted
                den += st.requests
            if den > 1e-9:
                return num / (den + 2.0 * batch)
        return 0.0

    def refresh(self, key: int, priors: dict[int, Prior], batch: int) -> None:
        """Rebuild bucket ``key``'s row: goodput per arm, the pick (kept unless another beats it by
        ``margin``), and the arm an exploration turn runs (None: none)."""
        c = self.cfg
        est = self.estimates(key, priors, batch)
        self.goodput[key] = {a: g for a, (g, _) in est.items()}
        arms = self.stats.get(key, {})
        # a depth committing under 1 + margin tokens a request cannot beat plain decoding by the margin
        cands = [a for a in est if a == 0 or priors[a][0] >= 1 + c.margin]
        if self.visits.get(key, 0) >= c.warm_visits:  # past the warm-up: arms served here
            cands = [a for a in cands if (arms.get(a) or _NONE).n >= c.pick_cycles] or cands
        best = max(cands, key=lambda a: est[a][0])
        cur = self.chosen.get(key)
        if cur in cands and est[best][0] < est[cur][0] * (1 + c.margin):
            best = cur
        if cur is not None and best != cur:
            self.changes.append((self.turns, key, cur, best, est[cur][0], est[best][0], priors[cur][0],
                                 priors[best][0], (arms.get(cur) or _NONE).n, (arms.get(best) or _NONE).n))
        self.chosen[key] = best
        others = [a for a in est if a != best and (a == 0 or priors[a][0] >= 1 + c.margin)]
        # unmeasured plain decoding (the floor) first, then the best upper bound past the pick by the margin,
        # else the pick's neighbours once their cycles have faded, whatever their bound
        faded = [a for a in others if (a == 0 or abs(a - best) == 1) and (arms.get(a) or _NONE).n < c.min_cycles]
        bound = {a: est[a][0] + c.z * est[a][1] for a in others}
        ok = [a for a in others if bound[a] > est[best][0] * (1 + c.margin)]
        self.explore[key] = (0 if 0 in faded else max(ok, key=lambda a: bound[a]) if ok
                             else min(faded) if faded else None)

    def due(self, key: int, arm: int) -> bool:
        """Whether bucket ``key``'s row is due a rebuild after a cycle of ``arm``: after any arm but the pick,
        in the bucket's warm-up, else every ROW_CYCLES cycles."""
        n = self._fresh.get(key, 0) + 1
        if arm != self.chosen.get(key) or self.visits.get(key, 0) < self.cfg.warm_visits or n >= ROW_CYCLES:
            n = 0
        self._fresh[key] = n
        return n == 0

    # -- measurements --------------------------------------------------------------------------
    def observe(self, key: int, arm: int, predicted: float, tokens: float, seconds: float, requests: int) -> None:
        """A served cycle of ``arm`` for ``requests`` requests: predicted and measured seconds, committed tokens."""
        if seconds <= 0 or predicted <= 0 or requests <= 0:
            return
        r = self._run
        if r is not None and r.key == key and r.arm == arm and r.requests == requests:  # the pick again
            seconds = min(seconds, r.cap)
            r.k += 1
            r.n = r.n * r.f + 1.0
            r.seconds = r.seconds * r.f + seconds
            r.predicted = r.predicted * r.f + predicted
            r.elapsed = r.elapsed * r.g + seconds
            return
        self._fold()
        c = self.cfg
        arms = self.stats.setdefault(key, {})
        est = self.spr.get(key, _EMPTY).get(arm)
        cap = c.clip * est * requests if est is not None else math.inf
        seconds = min(seconds, cap)  # a pause is not the arm's
        for st in arms.values():
            st.fade(c.decay)
        st = arms.get(arm)
        if st is None:
            st = arms[arm] = ArmStats()
        st.n += 1
        st.requests += requests
        st.seconds += seconds
        st.predicted += predicted
        st.seed_n = max(st.seed_n - 1.0, 0.0)
        self._account(key, arm, tokens, seconds, requests)
        if arm == self.chosen.get(key):
            self._run = PickRun(key, arm, requests, cap, c.decay, c.budget_decay)

    def _fold(self) -> None:
        """The open run's cycles into the stats and the budget: [s1, s2] -> stats * f^2 + s1 * f + s2."""
        r, self._run = self._run, None
        if r is None or not r.k:
            return
        fk, gk = r.f**r.k, r.g**r.k
        arms = self.stats[r.key]
        for st in arms.values():
            st.fade(fk)
        st = arms[r.arm]
        st.n += r.n
        st.requests += r.n * r.requests
        st.seconds += r.seconds
        st.predicted += r.predicted
        st.seed_n = max(st.seed_n - r.k, 0.0)
        self.elapsed[r.key] = self.elapsed.get(r.key, 0.0) * gk + r.elapsed
        self.spent[r.key] = self.spent.get(r.key, 0.0) * gk

    def seed(self, key: int, arm: int, seconds: float, requests: int, cycles: float = 2.0) -> None:
        """``cycles`` pseudo-cycles of ``arm`` in bucket ``key``, ``seconds`` each, timed before serving."""
        if seconds > 0 and requests > 0 and cycles > 0:
            self._fold()
            st = self.stats.setdefault(key, {}).setdefault(arm, ArmStats())
            st.seed_n, st.seed_spr = cycles, seconds / requests

    def charge(self, key: int, arm: int, tokens: float, seconds: float, requests: int, explored: bool = False) -> None:
        """A cycle left out of ``arm``'s measure (a one-off switch): still counted against the budget. An
        exploration of plain decoding (``explored``, arm 0) runs one cycle more, once, to measure two."""
        self._fold()
        if explored and arm == 0 and key not in self._rerun and key not in self._again:
            self._again[key] = arm
            self._rerun.add(key)
        if seconds > 0 and requests > 0:
            self._account(key, arm, tokens, seconds, requests)

    def _account(self, key: int, arm: int, tokens: float, seconds: float, requests: int) -> None:
        """Seconds of bucket ``key``; a cycle off the pick loses what it took over the pick's time for its tokens."""
        f = self.cfg.budget_decay
        self.elapsed[key] = self.elapsed.get(key, 0.0) * f + seconds
        lost = 0.0
        best = self.goodput.get(key, _EMPTY).get(self.chosen.get(key, -1), 0.0)
        if arm != self.chosen.get(key) and best > 0:
            lost = max(seconds - tokens / best, 0.0)  # (best: the batch's tokens a second)
            self._last_loss[key] = self._last_loss.get(key, 0.0) + lost
        self.spent[key] = self.spent.get(key, 0.0) * f + lost

    def summary(self) -> dict:
        """Per bucket (as its batch size) and arm: served cycles (decayed), estimated tok/s of the batch."""
        self._fold()
        return {bucket_batch(key): {a: {"cycles": round((self.stats.get(key, {}).get(a) or _NONE).n, 1),
                                        "tok_per_s": round(g, 2)} for a, g in sorted(row.items())}
                | {"pick": self.chosen.get(key), "explore": self.explore.get(key)}
                for key, row in sorted(self.goodput.items())}

    def pick_changes(self, since: int = 0) -> list[dict]:
        """The kept pick changes after decision ``since`` (``turns``), oldest first: what each arm's row read."""
        return [{"turn": t, "batch": bucket_batch(key), "from": a, "to": b,
                 "goodput": [round(ga, 2), round(gb, 2)], "tokens": [round(ta, 3), round(tb, 3)],
                 "cycles": [round(na, 1), round(nb, 1)]}
                for t, key, a, b, ga, gb, ta, tb, na, nb in self.changes if t > since]

    def budget_summary(self) -> dict:
        """Per bucket (as its batch size): seconds explorations lost, seconds of its cycles (decayed)."""
        self._fold()
        return {bucket_batch(key): {"spent_s": round(self.spent.get(key, 0.0), 4), "elapsed_s": round(v, 3)}
                for key, v in sorted(self.elapsed.items())}
