"""Measured cycle times per (batch size, draft depth): what the adaptive controller decides by.

A cost model predicts a step's time from a table; on a noisy machine the table's error (10-15 %
per entry on a 2-core CPU) is larger than the gap between drafting 1 and 2 tokens, so a plan
picked from predictions alone wanders. Here every decision's cost is measured instead: the wall
time of the whole cycle it started (draft, verify, sampling, commit, scheduling: everything the
user waits for), kept per arm, where an arm is a uniform draft depth d (0 = plain decode) in one
batch-size bucket. What is kept is the ratio measured / predicted seconds, so the model still
accounts for the batch and prefill sizes varying inside a bucket, and an arm never run borrows
the ratio of those that did (with a wide uncertainty, ``prior_cv``, so it gets tried). Tokens:
one per request plus the acceptance model's expected accepted drafts (measured per draft position
over every arm's cycles, far less noisy than one cycle's count) times the arm's measured / expected
ratio of accepted drafts (pooled over buckets), which removes the model's bias at rare depths.

Choice: the arm with the best goodput = tokens / (predicted seconds x time ratio), kept unless another is better by ``margin`` and by one standard error of the difference
(hysteresis). Exploration: every ``explore_every`` decisions of a bucket, plain decoding or a
neighbour of the chosen arm if measured less than ``min_cycles``, else the arm with the highest
upper bound (``z`` standard errors) if that bound beats the chosen arm, runs for two cycles (the
first may pay a one-off switch, which the caller leaves unmeasured); an arm clearly worse stops
being tried. Old cycles fade (``decay`` per decision in the bucket), so uncertainty
grows back and a load that drifts is followed. Pure numbers: no clock, no tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def batch_key(batch: int) -> int:
    """Half-octave buckets centred on powers of two: 31 and 32 requests share one (a closed loop at
    C = 32 runs 31 while a finished request's successor prefills)."""
    return int(round(2 * math.log2(max(batch, 1))))


@dataclass
class ArmStats:
    """Decayed sums over the cycles an arm ran: r = measured / predicted seconds."""

    n: float = 0.0
    r: float = 0.0
    r2: float = 0.0
    tokens: float = 0.0  # measured, for reports
    seconds: float = 0.0

    def fade(self, f: float) -> None:
        self.n *= f
        self.r *= f
        self.r2 *= f
        self.tokens *= f
        self.seconds *= f

    def add(self, ratio: float, tokens: float, seconds: float) -> None:
        self.n += 1
        self.r += ratio
        self.r2 += ratio * ratio
        self.tokens += tokens
        self.seconds += seconds

    def cv(self, default: float, strength: float = 4.0) -> float:
        """Coefficient of variation of one cycle's ratio, shrunk towards ``default``."""
        var = 0.0
        if self.n > 1e-9 and self.r > 0:
            m = self.r / self.n
            var = max(self.r2 / self.n - m * m, 0.0) / (m * m)
        return math.sqrt((self.n * var + strength * default**2) / (self.n + strength))


@dataclass
class TokenStats:
    """Decayed sums of accepted drafts (committed tokens less one per request), measured and
    expected, over an arm's cycles."""

    requests: float = 0.0
    tokens: float = 0.0
    expected: float = 0.0

    def fade(self, f: float) -> None:
        self.requests *= f
        self.tokens *= f
        self.expected *= f


Prior = tuple[float, float]  # expected tokens, predicted seconds of one cycle


@dataclass
class GoodputBandit:
    decay: float = 0.995  # per decision in a bucket: ~200 cycles of memory
    prior_cv: float = 0.3  # how far an arm's time ratio may be from the bucket's before it ran
    default_cv: float = 0.15  # of one cycle's time ratio, before its own spread is measured
    token_prior_cv: float = 0.05  # how far committed / expected tokens may be from 1 before measured
    token_cv: float = 0.5  # of one request's committed / expected tokens (accept counts vary a lot)
    z: float = 1.5  # standard errors of optimism when exploring
    margin: float = 0.02  # a better arm must beat the chosen one by this fraction to replace it
    explore_every: int = 16  # an exploration runs two cycles: the first may pay a switch (a catch-up)
    min_cycles: float = 2.0  # (decayed) cycles plain decoding and the chosen arm's neighbours keep
    token_decay: float = 0.995  # per cycle of the arm
    stats: dict[int, dict[int, ArmStats]] = field(default_factory=dict)  # bucket -> arm -> time ratios
    token_stats: dict[int, "TokenStats"] = field(default_factory=dict)  # arm -> committed vs. expected tokens
    chosen: dict[int, int] = field(default_factory=dict)  # bucket -> arm exploited last
    visits: dict[int, int] = field(default_factory=dict)  # decisions per bucket
    _explore_again: dict[int, int] = field(default_factory=dict)  # bucket -> arm explored once so far

    def _bucket_ratio(self, key: int) -> float:
        arms = self.stats.get(key, {})
        n = sum(st.n for st in arms.values())
        return sum(st.r for st in arms.values()) / n if n > 1e-9 else 1.0

    @staticmethod
    def _posterior(st: ArmStats | None, prior: float, prior_cv: float, default_cv: float) -> tuple[float, float]:
        """(mean, relative standard error) of a ratio: a normal prior updated by the arm's cycles."""
        prec = 1.0 / (prior_cv * prior) ** 2
        acc = prec * prior
        if st is not None and st.n > 1e-9:
            var = (st.cv(default_cv) * st.r / st.n) ** 2  # of one cycle's ratio
            prec += st.n / var
            acc += st.r / var
        mean = acc / prec
        return mean, 1.0 / (mean * prec**0.5)

    def _token_ratio(self, arm: int) -> tuple[float, float]:
        """(committed / expected accepted drafts, relative standard error) of an arm: a ratio of sums
        over its requests (``token_cv`` per request), shrunk towards 1 (``token_prior_cv``)."""
        st = self.token_stats.get(arm)
        prec = 1.0 / self.token_prior_cv**2
        acc = prec
        if st is not None and st.expected > 1e-9:
            data = st.requests / self.token_cv**2
            prec += data
            acc += data * st.tokens / st.expected
        mean = acc / prec
        return mean, 1.0 / (mean * prec**0.5)

    def estimates(self, key: int, priors: dict[int, Prior], batch: int = 1) -> dict[int, tuple[float, float]]:
        """(goodput, standard error) per arm: ``batch`` tokens (one per request) + expected accepted
        drafts x the arm's measured token ratio, over
        predicted seconds x the arm's time ratio (an arm never run borrows the bucket's, with
        ``prior_cv`` uncertainty)."""
        base = self._bucket_ratio(key)
        arms = self.stats.get(key, {})
        out = {}
        for arm, (tokens, sec) in priors.items():
            t, t_se = self._posterior(arms.get(arm), base, self.prior_cv, self.default_cv)
            a, a_se = self._token_ratio(arm)
            bonus = max(tokens - batch, 0.0)  # expected accepted drafts: the part a corrects
            total = batch + bonus * a
            g = total / (sec * t) if sec > 0 else 0.0
            out[arm] = (g, g * math.hypot(t_se, a_se * bonus * a / total if total > 0 else 0.0))
        return out

    def choose(self, key: int, priors: dict[int, Prior], batch: int = 1) -> tuple[int, bool]:
        """(arm, exploring) for the next cycle of ``batch`` requests in bucket ``key``."""
        est = self.estimates(key, priors, batch)
        visit = self.visits.get(key, 0)
        self.visits[key] = visit + 1
        again = self._explore_again.pop(key, None)
        if again in est:  # an exploration's second cycle (its first paid the switch)
            return again, True
        best = max(est, key=lambda a: est[a][0])
        cur = self.chosen.get(key)
        if cur in est and cur != best:
            (gb, sb), (gc, sc) = est[best], est[cur]
            cur_st = self.stats.get(key, {}).get(cur)
            # the noise band only once the current arm has cycles of its own: a pick made on the
            # prior alone is left as soon as the prior (or a measurement) says otherwise
            band = math.hypot(sb, sc) if cur_st is not None and cur_st.n >= 2 else 0.0
            if gb - gc < max(self.margin * gc, band):
                best = cur
        self.chosen[key] = best
        if self.explore_every and visit % self.explore_every == self.explore_every - 1:
            others = [a for a in est if a != best]
            # plain decoding and the chosen arm's neighbours are measured whatever the prior says:
            # plain decoding is what speculation must never fall below, and a profile of the wrong
            # shape (taken eagerly where steps replay graphs) can put any arm far off
            arms = self.stats.get(key, {})
            must = [a for a in others if (a == min(est) or abs(a - best) == 1)
                    and (arms[a].n if a in arms else 0.0) < self.min_cycles]
            alt = None
            if must:
                alt = min(must, key=lambda a: arms[a].n if a in arms else 0.0)
            elif others:
                top = max(others, key=lambda a: est[a][0] + self.z * est[a][1])
                if est[top][0] + self.z * est[top][1] > est[best][0]:
                    alt = top
            if alt is not None:
                self._explore_again[key] = alt
                return alt, True
        return best, False

    def observe(self, key: int, arm: int, predicted: float, expected: float, tokens: float, seconds: float,
                requests: int = 1) -> None:
        """A cycle of ``arm``: its predicted and measured seconds, the tokens expected and committed
        by its ``requests``."""
        if seconds <= 0 or predicted <= 0 or expected <= 0:
            return
        arms = self.stats.setdefault(key, {})
        for st in arms.values():
            st.fade(self.decay)
        arms.setdefault(arm, ArmStats()).add(seconds / predicted, tokens, seconds)
        # the acceptance model's bias per depth does not depend on the batch: pooled over buckets
        if expected > requests:  # accepted drafts vs. expected: nothing to learn from plain decode
            ts = self.token_stats.setdefault(arm, TokenStats())
            ts.fade(self.token_decay)
            ts.requests += requests
            ts.tokens += tokens - requests
            ts.expected += expected - requests

    def summary(self) -> dict:
        """Per bucket (as its batch size) and arm: cycles (decayed), measured/predicted time, tok/s."""
        out: dict[int, dict[int, dict]] = {}
        for key, arms in sorted(self.stats.items()):
            for arm, st in sorted(arms.items()):
                if st.n >= 1e-3:
                    out.setdefault(round(2 ** (key / 2)), {})[arm] = {
                        "cycles": round(st.n, 1), "time_ratio": round(st.r / st.n, 3),
                        "tok_per_s": round(st.tokens / st.seconds, 2)}
        out["token_ratio"] = {arm: round(st.tokens / st.expected, 3) for arm, st in sorted(self.token_stats.items())
                              if st.expected > 1e-3}
        return out
