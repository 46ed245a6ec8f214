"""Step costs as tables (exact to EXACT tokens, a grid above): target step time vs. tokens, draft time vs.
batch; a start-up profile, shifted online by measured buckets' medians (docs/decisions.md, "Cost model")."""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)
EXACT = 16
GRID: tuple[int, ...] = (*range(1, EXACT + 1), 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192,
                         224, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 2048, 3072, 4096)
FORMAT_VERSION = 5  # of a cached profile: another version is profiled again


def bucket(x: float) -> int:
    """The grid point a measurement at x is credited to: x itself up to EXACT, else the nearest one."""
    x = max(int(round(x)), 1)
    if x <= EXACT:
        return x
    i = bisect.bisect_left(GRID, x)
    if i >= len(GRID):
        return GRID[-1]
    lo, hi = GRID[i - 1], GRID[i]
    return lo if x - lo <= hi - x else hi


def batch_bucket(num_seqs: int) -> int:
    """Requests in a step, rounded up to a power of two: steps of the same token count but very
    different batch (32 decodes vs. 8 requests x 4 verify tokens) do not cost the same."""
    return 1 << max(int(num_seqs) - 1, 0).bit_length()


def _interp1(xs: list[float], ys: list[float], x: float) -> float:
    """``_interp`` at one point, in plain Python (cheaper than numpy for one point)."""
    n = len(xs)
    if n == 0:
        return 0.0
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        if n == 1:
            return ys[0] * x / xs[0]
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + max(slope, 0.0) * (x - xs[-1])
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _interp(xs: np.ndarray, ys: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Piecewise-linear through (xs, ys); flat below the first point, the last segment's slope past the last."""
    out = np.interp(x, xs, ys)
    if len(xs) >= 2:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        past = x > xs[-1]
        out = np.where(past, ys[-1] + np.maximum(slope, 0.0) * (x - xs[-1]), out)
    elif len(xs) == 1:
        out = np.where(x > xs[0], ys[0] * x / xs[0], out)  # one point: proportional past it
    return out


@dataclass
class Curve:
    """Seconds vs. a count (tokens in a target step, or requests in one draft forward)."""

    profile: dict[int, float] = field(default_factory=dict)  # start-up measurement per grid point
    min_samples: int = 3  # observations a bucket needs before their median replaces the profile there
    window: int = 16  # most recent observations kept per bucket
    samples: dict[int, deque] = field(default_factory=dict)
    measured: bool = False  # some bucket has min_samples observations (its median is in the table)
    _table: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    _pxy: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    # (median, count) per bucket with samples; buckets observed since the last table rebuild are stale
    _med: dict[int, tuple[float, int]] | None = field(default=None, repr=False)
    _stale_med: set[int] = field(default_factory=set, repr=False)
    # the table and the profile as lists, for one-point predictions (_interp1)
    _tlist: list[float] = field(default_factory=list, repr=False)
    _tlist_y: list[float] = field(default_factory=list, repr=False)
    _plist: list[float] = field(default_factory=list, repr=False)
    _plist_y: list[float] = field(default_factory=list, repr=False)
    _pat: dict[float, float] = field(default_factory=dict, repr=False)  # profile_at's points
    _pxy_of: dict | None = field(default=None, repr=False)  # the profile _pxy was made of

    def _medians(self) -> dict[int, tuple[float, int]]:
        if self._med is None:
            self._med = {g: (median(s), len(s)) for g, s in self.samples.items() if s}
        elif self._stale_med:
            for g in self._stale_med:
                s = self.samples[g]
                self._med[g] = (median(s), len(s))
        self._stale_med.clear()
        return self._med

    def _profile_xy(self) -> tuple[np.ndarray, np.ndarray]:
        if self._pxy is None or self._pxy_of is not self.profile or len(self._pxy[0]) != len(self.profile):
            self._pxy_of = self.profile  # (a profile taken again is a new dict)
            xs = np.array(sorted(self.profile), dtype=float)
            self._pxy = (xs, np.array([self.profile[int(k)] for k in xs]))
            self._plist, self._plist_y = self._pxy[0].tolist(), self._pxy[1].tolist()
            self._pat = {}
        return self._pxy

    def profile_at(self, x: float) -> float:
        """The profile alone (no observations), interpolated (remembered per x)."""
        if not self.profile:
            return 0.0
        self._profile_xy()  # fills the list copies (and empties the remembered points when it changed)
        p = self._pat.get(x)
        if p is None:
            p = self._pat[x] = _interp1(self._plist, self._plist_y, float(x))
        return p

    @property
    def profile_top(self) -> float:
        """The profile's largest count (0 without one)."""
        if not self.profile:
            return 0.0
        self._profile_xy()
        return self._plist[-1]

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """(counts, seconds), non-decreasing: the profile shifted by measured buckets' offsets; a bucket with
        ``min_samples`` its median, one with fewer a log-average of median and prior."""
        if self._table is not None:
            return self._table
        med = self._medians()
        prior: dict[int, float] = dict(self.profile)
        if self.profile:
            px, py = self._profile_xy()
            rx = [g for g in sorted(med) if med[g][1] >= self.min_samples]
            at = _interp(px, py, np.array(rx, dtype=float))
            if rx:
                # an offset, not a ratio: the profile's increments between token counts are kept
                off = np.interp(px, rx, np.array([med[g][0] for g in rx]) - at)
                prior = dict(zip(self._plist, np.maximum(py + off, 0.1 * py).tolist()))
        pts = dict(prior)
        if prior:
            qx = sorted(prior)
            qy = [prior[x] for x in qx]
        for g, (m, n) in med.items():
            if n >= self.min_samples or not prior:
                pts[g] = m
            else:
                p = prior[g] if g in prior else _interp1(qx, qy, float(g))
                pts[g] = math.exp((n * math.log(m) + math.log(p)) / (n + 1)) if p > 0 and m > 0 else m
        keys = sorted(pts)
        xs = np.array(keys, dtype=float)
        ys = np.array([pts[x] for x in keys])
        # a forward over more tokens (or requests) never takes less time
        self._table = (xs, np.maximum.accumulate(ys) if len(ys) else ys)
        self._tlist, self._tlist_y = self._table[0].tolist(), self._table[1].tolist()
        return self._table

    def predict(self, x: float) -> float:
        self.table()
        return _interp1(self._tlist, self._tlist_y, float(x))

    def predict_as_last_built(self, x: float) -> float:
        """``predict`` from the table as last built (observations since left out), where there is one."""
        if not self._tlist:
            return self.predict(x)
        return _interp1(self._tlist, self._tlist_y, float(x))

    def observe(self, x: float, seconds: float) -> None:
        g = bucket(x)
        if g != x:  # credit to the grid point, scaled by the curve's shape (the profile's, when there is one)
            px, pg = (self.profile_at(x), self.profile_at(g)) if self.profile else (self.predict(x), self.predict(g))
            if px > 0 and pg > 0:
                seconds *= pg / px
        s = self.samples.get(g)
        if s is None:
            s = self.samples[g] = deque(maxlen=self.window)
        s.append(seconds)
        self.measured = self.measured or len(s) >= self.min_samples
        if self._med is not None:
            self._stale_med.add(g)
        self._table = None


@dataclass
class LinearCost:
    """seconds = fixed + per_unit x units, least squares over decayed sums (each observation weighs
    ``decay`` x the one after it): a catch-up is a few launches plus a head pass per token."""

    decay: float = 0.8
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        d = self.decay
        self.n = d * self.n + 1
        self.sx = d * self.sx + units
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + units * units
        self.sxy = d * self.sxy + units * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_unit), both >= 0; None before any observation. Through the origin (the ratio
        of the sums: large observations weigh most) where the sizes seen do not separate the two."""
        if self.n <= 0 or self.sx <= 0:
            return None
        den = self.n * self.sxx - self.sx * self.sx
        if den > 1e-9 * self.n * self.sxx:  # at least two distinct sizes
            b = (self.n * self.sxy - self.sx * self.sy) / den
            a = (self.sy - b * self.sx) / self.n
            if b > 0 and a >= 0:
                return a, b
        return 0.0, self.sy / self.sx

    def predict(self, units: float) -> float | None:
        f = self.fit()
        return None if f is None else f[0] + f[1] * units


@dataclass
class CostModel:
    target: Curve = field(default_factory=Curve)  # seconds per target step vs. tokens in it, all batches
    by_batch: dict[int, Curve] = field(default_factory=dict)  # the same per batch_bucket(requests in the step)
    # start-up profile per batch bucket b: steps of b requests x 1..k+1 tokens each (a verify step's shape)
    batch_profiles: dict[int, dict[int, float]] = field(default_factory=dict)
    draft: Curve = field(default_factory=Curve)  # seconds per draft forward vs. requests in it
    errors: deque = field(default_factory=lambda: deque(maxlen=256))  # (measured - predicted) / predicted per step
    profile_ratios: deque = field(default_factory=lambda: deque(maxlen=256))  # measured / profile alone per step
    stale_ratio: float = 1.5  # profile flagged stale once the median measured/profile ratio leaves [1/x, x]
    stale_after: int = 64  # ... over at least this many steps
    meta: dict = field(default_factory=dict)  # how the profile was taken (date, spread, rounds)
    error_every: int = 16  # steps per sampled prediction error (a prediction after an observation rebuilds a table)
    _observed_steps: int = 0

    def curve(self, num_seqs: int | None = None) -> Curve:
        """The target curve for steps of this many requests: its batch bucket's when that has a
        profile or a measured bucket, else the curve of all steps."""
        if num_seqs is not None:
            b = batch_bucket(num_seqs)
            if b in self.batch_profiles or (b in self.by_batch and self.by_batch[b].measured):
                return self._batch_curve(b)
        return self.target

    def _batch_curve(self, b: int) -> Curve:
        """The curve of batch bucket b: its own profile where measured (b requests x t tokens), the
        all-batch profile past it (steps that also carry prefill)."""
        c = self.by_batch.get(b)
        if c is None:
            own = self.batch_profiles.get(b, {})
            top = max(own, default=0)
            profile = {**{n: s for n, s in self.target.profile.items() if n > top}, **own}
            c = self.by_batch[b] = Curve(profile, self.target.min_samples, self.target.window)
        return c

    def step_time(self, num_tokens: float, num_seqs: int | None = None) -> float:
        return self.curve(num_seqs).predict(num_tokens)

    def observe_step(self, num_tokens: int, seconds: float, num_seqs: int | None = None) -> float | None:
        """Record a measured target step; returns what was predicted for it (None without a curve,
        or on a step whose error is not sampled)."""
        self._observed_steps += 1
        pred = None
        if (self.target.profile or self.target.samples) and self._observed_steps % self.error_every == 1 % self.error_every:
            # (from the curve's table as last built: the error of the predictions decisions were taking)
            pred = self.curve(num_seqs).predict_as_last_built(num_tokens)
        if pred:
            self.errors.append((seconds - pred) / pred)
        if self.target.profile and num_tokens <= self.target.profile_top:
            p = self.target.profile_at(num_tokens)
            if p > 0:
                self.profile_ratios.append(seconds / p)
        self.target.observe(num_tokens, seconds)
        if num_seqs is not None:
            self._batch_curve(batch_bucket(num_seqs)).observe(num_tokens, seconds)
        return pred

    def observe_draft(self, batch: int, steps: int, seconds: float) -> None:
        if steps > 0 and batch > 0:
            self.draft.observe(batch, seconds / steps)

    @property
    def mean_abs_error(self) -> float | None:
        return sum(abs(e) for e in self.errors) / len(self.errors) if self.errors else None

    @property
    def profile_ratio(self) -> float | None:
        return median(self.profile_ratios) if self.profile_ratios else None

    @property
    def stale(self) -> bool:
        r = self.profile_ratio
        return (r is not None and len(self.profile_ratios) >= self.stale_after
                and not 1 / self.stale_ratio <= r <= self.stale_ratio)

    def summary(self) -> dict:
        """Observable state: prediction error, measured/profile ratio, the curves in ms."""
        xs, ys = self.target.table()
        dx, dy = self.draft.table()
        return {"mean_abs_error": self.mean_abs_error, "profile_ratio": self.profile_ratio, "stale": self.stale,
                "target_ms": {int(x): round(y * 1e3, 3) for x, y in zip(xs, ys)},
                "draft_ms": {int(x): round(y * 1e3, 3) for x, y in zip(dx, dy)},
                "target_samples": {g: len(s) for g, s in sorted(self.target.samples.items())},
                "target_ms_by_batch": {b: {int(x): round(y * 1e3, 3) for x, y in zip(*c.table())}
                                       for b, c in sorted(self.by_batch.items())}}

    # -- persistence (the profile only; observations are this run's) --------------------------
    def to_json(self) -> dict:
        return {"version": FORMAT_VERSION, "meta": self.meta,
                "target": {str(k): v for k, v in sorted(self.target.profile.items())},
                "draft": {str(k): v for k, v in sorted(self.draft.profile.items())},
                "by_batch": {str(b): {str(k): v for k, v in sorted(p.items())} for b, p in sorted(self.batch_profiles.items())}}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"cost profile format {d.get('version')}, want {FORMAT_VERSION}")
        return cls(target=Curve({int(k): float(v) for k, v in d["target"].items()}),
                   draft=Curve({int(k): float(v) for k, v in d["draft"].items()}), meta=dict(d.get("meta", {})),
                   batch_profiles={int(b): {int(k): float(v) for k, v in p.items()}
                                   for b, p in d.get("by_batch", {}).items()})

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "CostModel | None":
        try:
            with open(path) as f:
                return cls.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def profile_points(max_count: int) -> list[int]:
    """Counts to profile, up to max_count (all on GRID): every one up to EXACT, steps of 4 to 32, then
    x1.5 / x2 (48, 64, 96, 128, ...); the buckets in between interpolate until observed."""
    pts = list(range(1, EXACT + 1)) + [20, 24, 28, 32]
    while pts[-1] < GRID[-1]:
        pts += [pts[-1] * 3 // 2, pts[-1] * 2]
    return [p for p in pts if p <= max_count]


@dataclass
class Measurement:
    seconds: dict[int, float]  # median per point
    spread: dict[int, float]  # (max - min) / min of the round medians per point
    rounds: int  # rounds completed over all points
    rechecked: list[int]
    seconds_taken: float = 0.0
    over_budget: bool = False

    @property
    def noisy(self) -> bool:
        """Too noisy to keep for later runs: the typical point's rounds disagree by > 30 %, or the
        budget ran out before the rounds did."""
        return self.over_budget or median(self.spread.values()) > 0.3


def measure(points: list[int], fn: Callable[[int], None], rounds: int = 3, repeats: int = 3,
            recheck_spread: float = 0.15, sync: Callable[[], None] | None = None,
            clock: Callable[[], float] = time.perf_counter, budget_s: float = float("inf"),
            label: str = "step costs") -> Measurement:
    """Seconds of fn(n) per point: the median over rounds (each visits every point, alternately up and down) of
    ``repeats`` calls; spread points get two more rounds; no round starts past ``budget_s``."""
    start = clock()

    def once(n: int) -> float:
        ts = []
        for _ in range(repeats):
            t0 = clock()
            fn(n)
            if sync:
                sync()
            ts.append(clock() - t0)
        return median(ts)

    for n in points:  # warm-up: allocator, kernel selection
        fn(n)
    per: dict[int, list[float]] = {n: [] for n in points}
    done = 0
    over = False
    for r in range(rounds):
        if r > 0 and clock() - start > budget_s:
            over = True
            break
        for n in (points if r % 2 == 0 else points[::-1]):
            if clock() - start > budget_s:  # first round past the budget: one call per point left
                over = True
                t0 = clock()
                fn(n)
                per[n].append(clock() - t0)
            else:
                per[n].append(once(n))
        done += 1
        log.info("profiling %s: round %d of %d over %d points (%.1fs)", label, done, rounds, len(points),
                 clock() - start)

    def spread(n: int) -> float:
        v = per[n]
        return (max(v) - min(v)) / min(v) if min(v) > 0 else 0.0

    rechecked = [n for n in points if spread(n) > recheck_spread]
    for r in range(2):
        if clock() - start > budget_s:  # re-checks cut short: the rounds' medians stand
            break
        for n in (rechecked if r % 2 == 0 else rechecked[::-1]):
            per[n].append(once(n))
    return Measurement({n: median(v) for n, v in per.items()}, {n: spread(n) for n in points}, done, rechecked,
                       clock() - start, over)
