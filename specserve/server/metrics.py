"""Prometheus metrics for one front-end, fed by its engine client (client.py) on the event loop.

Engine-wide counters come from deltas of the engine's stats, which the engine core sends with
every step; per-request latencies are timed here with perf_counter from the moment the HTTP
handler received the request to the moment the front-end received the tokens.
Each app has its own CollectorRegistry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess


P = "specserve:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0)

# cumulative EngineStats field -> counter name (without the _total suffix prometheus adds)
_STAT_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens processed (prefill)."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "num_preemptions": ("num_preemptions", "Requests preempted for lack of KV blocks."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "steps": ("engine_steps", "Engine steps run."),
    "spec_steps": ("spec_steps", "Engine steps in which at least one request verified drafts."),
    "spec_verify_steps": ("spec_verify_steps", "Per-request verify passes (drafts checked by the target)."),
    "spec_draft_tokens": ("spec_draft_tokens", "Draft tokens proposed and verified."),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Draft tokens accepted."),
}


@dataclass
class _Timing:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None


class ServerMetrics:
    """One front-end's metrics. With several front-ends (PROMETHEUS_MULTIPROC_DIR set by the supervisor)
    each writes its own files and /metrics sums them; only ``engine_stats`` = True (front-end 0) exports
    the engine-wide counters and gauges, which every front-end receives."""

    def __init__(self, model_name: str, engine_stats: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.engine_stats = engine_stats
        r, label = self.registry, {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            # several front-ends: the largest value, i.e. front-end 0's (the others' stay 0)
            return Gauge(P + name, doc, labelnames=list(label), registry=r, multiprocess_mode="max").labels(**label)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            c = Counter(P + name, doc, labelnames=[*label, *extra], registry=r)
            return c if extra else c.labels(**label)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(P + name, doc, labelnames=list(label), buckets=buckets, registry=r).labels(**label)

        self._label = label
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.accept_length = gauge(
            "spec_avg_accept_length", "Tokens committed per verify step (accepted drafts + 1), engine lifetime."
        )
        self.spec_step_share = gauge("spec_step_share", "Share of engine steps that speculated, engine lifetime.")
        self.stat_counters = {f: counter(name, doc) for f, (name, doc) in _STAT_COUNTERS.items()}
        self.accepted_per_pos = counter(
            "spec_accepted_tokens_per_pos", "Draft tokens accepted at each draft position (0 = first).", ("position",)
        )
        self.drafted_per_pos = counter(
            "spec_draft_tokens_per_pos", "Draft tokens proposed at each draft position (0 = first).", ("position",)
        )
        self.k_chosen = counter("spec_k_chosen", "Per-request draft length k chosen by the controller.", ("k",))
        self.requests_finished = counter("request_success", "Requests finished, by finish reason.", ("finished_reason",))
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", _LATENCY_BUCKETS)
        self.tpot = hist(
            "request_time_per_output_token_seconds", "Per request: (e2e - ttft) / (output tokens - 1).", _LATENCY_BUCKETS
        )
        self.e2e = hist("e2e_request_latency_seconds", "Request latency from arrival to last token.", _LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per finished request.", _TOKEN_BUCKETS)
        self.req_accept_length = hist(
            "request_spec_accept_length", "Per finished request: tokens committed per verify step.", _ACCEPT_BUCKETS
        )
        self._prev: dict[str, Any] = {}
        self._timings: dict[str, _Timing] = {}
        self._gen_window: deque[tuple[float, int]] = deque()  # (time, cumulative generation tokens)

    def last_gen_throughput(self, window_s: float = 5.0) -> float:
        """Generated tokens per second over the last few seconds of steps (SGLang's last_gen_throughput)."""
        points = list(self._gen_window)
        if len(points) < 2:
            return 0.0
        t_end, n_end = points[-1]
        t0, n0 = next(((t, n) for t, n in points if t_end - t <= window_s), points[0])
        return (n_end - n0) / (t_end - t0) if t_end > t0 else 0.0

    def render(self) -> bytes:
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)

    # ------------------------------------------------------------ hooks (the engine client)

    def on_added(self, request_id: str, arrival_time: float) -> None:
        self._timings[request_id] = _Timing(arrival_time)

    def on_aborted(self, request_id: str) -> None:
        if self._timings.pop(request_id, None) is not None:
            self.requests_finished.labels(**self._label, finished_reason="abort").inc()

    def on_rejected(self, request_id: str) -> None:
        self._timings.pop(request_id, None)

    def on_stats(self, stats: Any, now: float) -> None:
        if self.engine_stats:
            self._update_stats(stats)
        self._gen_window.append((now, getattr(stats, "generation_tokens", 0) or 0))
        while len(self._gen_window) > 2 and now - self._gen_window[0][0] > 30.0:
            self._gen_window.popleft()

    # ------------------------------------------------------------ internals

    def _delta(self, key: str, value: float) -> float:
        prev = self._prev.get(key, 0)
        self._prev[key] = value
        return value - prev if value >= prev else value  # a reset counts from zero

    def _update_stats(self, s: Any) -> None:
        self.running.set(getattr(s, "num_running", 0))
        self.waiting.set(getattr(s, "num_waiting", 0))
        self.kv_usage.set(getattr(s, "kv_usage", 0.0))
        for f, c in self.stat_counters.items():
            d = self._delta(f, getattr(s, f, 0) or 0)
            if d:
                c.inc(d)
        for attr, counter in (("spec_accepted_per_position", self.accepted_per_pos),
                              ("spec_drafted_per_position", self.drafted_per_pos)):
            for pos, value in enumerate(getattr(s, attr, None) or []):
                d = self._delta(f"{attr}[{pos}]", value)
                child = counter.labels(**self._label, position=str(pos))  # exists (at 0) once drafted
                if d:
                    child.inc(d)
        for k, value in (getattr(s, "k_histogram", None) or {}).items():
            d = self._delta(f"k[{k}]", value)
            if d:
                self.k_chosen.labels(**self._label, k=str(k)).inc(d)
        accept = avg_accept_length(s)
        if accept is not None:
            self.accept_length.set(accept)
        steps = getattr(s, "steps", 0) or 0
        if steps:
            self.spec_step_share.set((getattr(s, "spec_steps", 0) or 0) / steps)

    def on_output(self, state: Any, n_new: int, now: float) -> None:
        """``state`` (client.RequestState) gained ``n_new`` tokens, received at ``now``."""
        t = self._timings.get(state.request_id)
        if t is None:
            return
        if n_new:
            if t.first_token is None:
                t.first_token = now
                self.ttft.observe(now - t.arrival)
            else:
                # Tokens committed together (one verify step) share the gap since the last ones.
                per_token = (now - (t.last_token or now)) / n_new
                for _ in range(n_new):
                    self.itl.observe(per_token)
            t.last_token = now
        if state.finished:
            del self._timings[state.request_id]
            n_gen = len(state.token_ids)
            self.requests_finished.labels(**self._label, finished_reason=state.finish_reason or "stop").inc()
            self.e2e.observe(now - t.arrival)
            self.prompt_len.observe(len(state.prompt_token_ids))
            self.gen_len.observe(n_gen)
            if t.first_token is not None and n_gen > 1:
                self.tpot.observe((now - t.first_token) / (n_gen - 1))
            f = state.final
            if f is not None and f.spec_verify_steps:
                self.req_accept_length.observe((f.spec_accepted_tokens + f.spec_verify_steps) / f.spec_verify_steps)


def avg_accept_length(stats: Any) -> float | None:
    """Tokens committed per verify step over the engine's lifetime; None if it never speculated."""
    value = getattr(stats, "avg_accept_length", None)
    if value is not None:
        return float(value)
    verify = getattr(stats, "spec_verify_steps", 0) or 0
    if not verify:
        return None
    return ((getattr(stats, "spec_accepted_tokens", 0) or 0) + verify) / verify
