"""A load's streams split over client processes (--client-processes), all starting together on one
clock: past ~16 streams one Python process parsing the SSE events, not the server, would set the pace."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import time
from typing import Any

from specserve.bench.datasets import BenchRequest
from specserve.bench.metrics import RequestResult
from specserve.bench.ramp import RampSpec
from specserve.bench.serving import CLIENT_START_S, BenchConfig, make_client, run_fixed, run_ramp


def default_client_processes(concurrency: int) -> int:
    """Enough client processes for ~16 streams each, leaving the server two cores and one each."""
    return max(1, min(8, concurrency // 16, ((os.cpu_count() or 2) - 2) // 2))


def _shares(total: int, parts: int) -> list[int]:
    """10 over 3 -> [4, 3, 3]"""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _client_process_ready(ready: Any) -> None:
    """A client process's start: this module imported (the parts' code), then say so."""
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    ready.put(os.getpid())


def _client_part(cfg: BenchConfig, model: str, requests: list[BenchRequest], ramp: RampSpec | None,
                 start_at: float) -> tuple[list[RequestResult], float, float]:
    """One client process's share of a load, started at perf_counter() ``start_at`` (one clock for the
    processes of a host); (results, t0, duration)."""

    async def go() -> tuple[list[RequestResult], float, float]:
        async with make_client(cfg, max(ramp.levels) if ramp else cfg.max_concurrency or len(requests)) as client:
            if ramp is not None:
                return await run_ramp(client, cfg, model, requests, ramp, start_at)
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
            return await run_fixed(client, cfg, model, requests)

    return asyncio.run(go())


class ClientProcesses:
    """A load's streams split over ``processes`` client processes: one Python process parses ~25k SSE
    events/s, so at high concurrency it, not the server, would set the pace. Process i of P takes
    requests[i::P] and its share of the concurrency (of each ramp level), all starting together."""

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"client processes must be >= 1, got {processes}")
        self.processes = processes
        self.pool = None
        if processes > 1:  # started and ready before any load: a part that starts late has lost its start
            ctx = multiprocessing.get_context("spawn")
            ready = ctx.Queue()
            self.pool = ctx.Pool(processes, initializer=_client_process_ready, initargs=(ready,))
            for _ in range(processes):
                ready.get(timeout=120)

    def parts(self, cfg: BenchConfig, requests: list[BenchRequest], ramp: RampSpec | None = None) -> int:
        """How many processes this load is split over."""
        streams = max(ramp.levels) if ramp is not None else min(cfg.max_concurrency or len(requests), len(requests))
        return max(1, min(self.processes, streams))

    def run(self, cfg: BenchConfig, model: str, requests: list[BenchRequest], ramp: RampSpec | None = None,
            start_at: float | None = None) -> tuple[list[RequestResult], float, float]:
        """(results, t0, duration): every request's result, its times on this process's perf_counter."""
        p = self.parts(cfg, requests, ramp)
        start_at = time.perf_counter() + CLIENT_START_S if start_at is None else start_at
        if p == 1 or self.pool is None:
            return _client_part(cfg, model, requests, ramp, start_at)
        conc = _shares(cfg.max_concurrency, p) if cfg.max_concurrency else [None] * p
        levels = list(zip(*(_shares(level, p) for level in ramp.levels))) if ramp is not None else [()] * p
        jobs = [(dataclasses.replace(cfg, max_concurrency=conc[i], request_rate=cfg.request_rate / p,
                                     seed=cfg.seed + i, disable_tqdm=True),
                 model, requests[i::p], None if ramp is None else RampSpec(levels[i], ramp.step_duration_s), start_at)
                for i in range(p)]
        parts = self.pool.starmap(_client_part, jobs)
        results = []
        for i, (part, _, _) in enumerate(parts):
            for r in part:
                r.index = r.index * p + i  # part i's j-th request was requests[i + j * p]
                results.append(r)
        results.sort(key=lambda r: r.index)
        t0 = min(t for _, t, _ in parts)
        return results, t0, max(t + d for _, t, d in parts) - t0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None
