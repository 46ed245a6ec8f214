"""Measured step costs: target forward time vs. tokens per step, draft time vs. batch.

Both are piecewise-linear tables over powers of two, filled by a short start-up profile on the
device the engine runs on and refined online (EMA) from every measured step. Predictions and
their recent relative errors are kept so they can be observed.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field

GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


@dataclass
class CurveTable:
    """f(x) on GRID points, linear in between (and extrapolated linearly past the last point)."""

    values: dict[int, float] = field(default_factory=dict)
    alpha: float = 0.2  # EMA weight of a new measurement

    def observe(self, x: float, seconds: float) -> None:
        # credit the measurement to the nearest grid point, scaled to it by the current curve's shape
        g = min(GRID, key=lambda p: abs(math.log2(max(x, 1)) - math.log2(p)))
        pred_x = self.predict(x)
        pred_g = self.predict(g)
        target = seconds * (pred_g / pred_x) if pred_x and pred_g else seconds
        old = self.values.get(g)
        self.values[g] = target if old is None else (1 - self.alpha) * old + self.alpha * target

    def predict(self, x: float) -> float:
        if not self.values:
            return 0.0
        pts = sorted(self.values)
        if x <= pts[0]:
            return self.values[pts[0]]
        if x >= pts[-1]:
            if len(pts) == 1:
                return self.values[pts[-1]] * x / pts[-1]
            a, b = pts[-2], pts[-1]
        else:
            i = bisect.bisect_right(pts, x)
            a, b = pts[i - 1], pts[i]
        ya, yb = self.values[a], self.values[b]
        return ya + (yb - ya) * (x - a) / (b - a)


@dataclass
class CostModel:
    target: CurveTable = field(default_factory=CurveTable)  # seconds per target step vs. tokens in it
    draft: CurveTable = field(default_factory=CurveTable)  # seconds per draft forward vs. batch
    errors: list[float] = field(default_factory=list)  # recent relative errors of step predictions

    def step_time(self, num_tokens: int) -> float:
        return self.target.predict(num_tokens)

    def draft_time(self, batch_per_step: list[int]) -> float:
        """Draft cost: one head forward per draft step, each over that step's active requests."""
        return sum(self.draft.predict(b) for b in batch_per_step if b > 0)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        pred = self.target.predict(num_tokens)
        if pred > 0:
            self.errors.append((seconds - pred) / pred)
            del self.errors[:-256]
        self.target.observe(num_tokens, seconds)

    def observe_draft(self, batch: int, steps: int, seconds: float) -> None:
        if steps > 0:
            self.draft.observe(batch, seconds / steps)

    @property
    def mean_abs_error(self) -> float | None:
        return sum(abs(e) for e in self.errors) / len(self.errors) if self.errors else None

    def to_json(self) -> dict:
        return {"target": {str(k): v for k, v in self.target.values.items()},
                "draft": {str(k): v for k, v in self.draft.values.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        cm = cls()
        cm.target.values = {int(k): float(v) for k, v in d["target"].items()}
        cm.draft.values = {int(k): float(v) for k, v in d["draft"].items()}
        return cm

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CostModel | None":
        try:
            with open(path) as f:
                return cls.from_json(json.load(f))
        except (OSError, ValueError, KeyError):
            return None


def profile_grid(max_tokens: int, num_blocks: int) -> list[int]:
    """Token counts to profile: powers of two up to max_tokens, one KV block per fake request."""
    return [n for n in GRID if n <= min(max_tokens, num_blocks - 1)]


def time_call(fn, repeats: int = 3, sync=None) -> float:
    """Median wall time of fn() over ``repeats`` runs after one warm-up."""
    import time

    fn()
    if sync:
        sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]
