"""A load ramp: the concurrency schedule (``--ramp 1,8,32,8,1``) and its report, per ramp step and
per window of the run: output throughput, requests in flight and, from /metrics, k and accept length."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from specserve.bench.metrics import RequestResult

if TYPE_CHECKING:
    from specserve.bench.serving import MetricsScraper


@dataclass(frozen=True)
class RampSpec:
    levels: tuple[int, ...]
    step_duration_s: float

    def __post_init__(self) -> None:
        if not self.levels or any(c < 0 for c in self.levels) or max(self.levels) < 1:
            raise ValueError(f"ramp levels must be integers >= 0 (0: no load), one at least 1; "
                             f"got {list(self.levels)}")
        if self.step_duration_s <= 0:
            raise ValueError(f"ramp step duration must be > 0, got {self.step_duration_s}")

    @property
    def duration_s(self) -> float:
        return self.step_duration_s * len(self.levels)

    def level_at(self, t: float) -> int:
        """Target concurrency at t seconds into the run (0 once the schedule is over)."""
        i = int(t // self.step_duration_s)
        return self.levels[i] if 0 <= i < len(self.levels) else 0


def parse_int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"want a comma-separated list of integers, got {text!r}") from e
    if not vals:
        raise ValueError(f"want a comma-separated list of integers, got {text!r}")
    return vals


def expand_doubling(levels: list[int]) -> list[int]:
    """1,32,1 -> 1,2,4,8,16,32,16,8,4,2,1: powers-of-two steps between consecutive points."""
    out = [levels[0]]
    for target in levels[1:]:
        c = out[-1]
        while c != target:
            c = min(c * 2, target) if target > c else max(c // 2, target)
            out.append(c)
    return out


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def window_series(
    results: list[RequestResult], t0: float, duration: float, window_s: float,
    level_at: Callable[[float], int], scraper: MetricsScraper | None,
) -> list[dict[str, Any]]:
    """Per window of [0, duration): output tokens/s, completions, mean requests in flight, the
    target concurrency at the window's middle and, from /metrics, mean k and accept length."""
    ok = [r for r in results if r.success]
    token_events = [(t - t0, n) for r in ok for t, n in r.token_times()]
    n_windows = max(1, math.ceil(duration / window_s - 1e-6))
    out = []
    for w in range(n_windows):
        a, b = w * window_s, (w + 1) * window_s
        span = min(b, duration) - a
        tokens = sum(n for t, n in token_events if a <= t < b)
        inflight = sum(_overlap(r.start - t0, r.start - t0 + r.latency, a, b) for r in results)
        server = scraper.between(a, b) if scraper is not None else None
        out.append({
            "t_start_s": a,
            "t_end_s": a + span,
            "target_concurrency": level_at((a + min(b, duration)) / 2),
            "mean_inflight": inflight / span if span > 0 else None,
            "output_tokens": tokens,
            "output_throughput": tokens / span if span > 0 else None,
            "completed": sum(1 for r in ok if a <= r.start - t0 + r.latency < b),
            **_server_fields(server),
        })
    return out


def _server_fields(server: dict[str, Any] | None) -> dict[str, Any]:
    keys = ("mean_k", "k0_share", "accept_length", "spec_step_share")
    return {k: None if server is None else server[k] for k in keys}


def ramp_steps(
    results: list[RequestResult], t0: float, ramp: RampSpec, scraper: MetricsScraper | None
) -> list[dict[str, Any]]:
    """The same numbers per ramp step (one concurrency level each)."""
    ok = [r for r in results if r.success]
    out = []
    for j, level in enumerate(ramp.levels):
        a, b = j * ramp.step_duration_s, (j + 1) * ramp.step_duration_s
        tokens = sum(n for r in ok for t, n in r.token_times() if a <= t - t0 < b)
        tpots = [tp for r in ok if a <= r.start - t0 < b and (tp := r.tpot) is not None]
        server = scraper.between(a, b) if scraper is not None else None
        out.append({
            "concurrency": level,
            "t_start_s": a,
            "output_throughput": tokens / (b - a),
            "requests_started": sum(1 for r in results if a <= r.start - t0 < b),
            "mean_tpot_ms": float(np.mean(tpots)) * 1e3 if tpots else None,
            **_server_fields(server),
        })
    return out
