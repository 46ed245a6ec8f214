"""Serving benchmark: an async load generator over the OpenAI API with streaming.

    specserve bench serve --base-url http://127.0.0.1:8000 --dataset sharegpt \
        --num-prompts 64 --max-concurrency 8 --sharegpt-output-len 128 --ignore-eos \
        --output-file benchmarks/results/serve.json

Two load shapes: a fixed prompt list under a concurrency cap and an arrival rate (Poisson,
default infinite), or a ramp (``--ramp 1,8,32,8,1 --ramp-step-duration 20``): a closed loop
whose concurrency follows the list over time, reported as a per-window series of output
throughput and, when the server's /metrics exports them, k and accept length. Past ~16 streams
the load splits over client processes (client_processes.py, --client-processes) on one clock; this
process keeps the warm-up, the /metrics scrapes and the summary. Metric definitions are in metrics.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import itertools
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import numpy as np

from specserve.bench.datasets import BenchRequest
from specserve.bench.metrics import (
    RequestResult,
    metrics_delta,
    parse_prometheus,
    server_info_accept_length,
    spec_from_metrics,
    spec_series,
    summarize,
)
from specserve.bench.ramp import RampSpec, ramp_steps, window_series
from specserve.bench.tokenizer import BenchTokenizer

if TYPE_CHECKING:
    from specserve.bench.client_processes import ClientProcesses

SCHEMA_VERSION = 1
Endpoint = Literal["completions", "chat"]


@dataclass
class BenchConfig:
    """How requests are sent; the prompts themselves come separately (datasets.py)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: Endpoint = "chat"
    model: str | None = None  # served model name; None: the first one /v1/models lists
    max_concurrency: int | None = None
    request_rate: float = math.inf  # requests/s, Poisson arrivals
    warmup_requests: int = 1
    warmup_output_len: int = 16
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    # ask for the sampled token's logprob so each chunk says how many tokens it holds: the
    # stream's own count can then be checked against usage (costs the server a little)
    count_stream_tokens: bool = False
    request_timeout_s: float = 600.0
    api_key: str | None = None
    scrape_metrics: bool = True
    window_s: float = 2.0  # ramp series granularity
    save_requests: bool = False
    save_text: bool = False
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for no pacing), got {self.request_rate}")
        if self.warmup_requests < 0 or self.warmup_output_len < 1:
            raise ValueError("warmup_requests must be >= 0 and warmup_output_len >= 1")
        if self.request_timeout_s <= 0 or self.window_s <= 0:
            raise ValueError("request_timeout_s and window_s must be > 0")
        self.base_url = self.base_url.rstrip("/")


# ---------------------------------------------------------------------------------------------
# One streamed request


def build_body(cfg: BenchConfig, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.top_p is not None:
        body["top_p"] = cfg.top_p
    if cfg.top_k is not None:
        body["top_k"] = cfg.top_k
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.count_stream_tokens:
        body["logprobs"] = True if cfg.endpoint == "chat" else 0
    body.update(cfg.extra_body)
    return body


def _chunk_token_count(choice: dict[str, Any]) -> int | None:
    """Tokens in one streamed choice, when the chunk says: a ``token_ids`` list (extension) or
    per-token logprobs (completions: ``logprobs.tokens``; chat: ``logprobs.content``)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        for key in ("tokens", "content"):
            if isinstance(lp.get(key), list):
                return len(lp[key])
    return None


async def send_request(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, index: int, req: BenchRequest,
    max_tokens: int | None = None,
) -> RequestResult:
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    n_out = max_tokens or req.output_len
    body = build_body(cfg, model, req.prompt, n_out)
    res = RequestResult(index=index, expected_output_len=n_out, client_prompt_len=req.prompt_len)
    text_parts: list[str] = []
    pending_tokens = 0  # tokens announced by chunks that carried no text (held-back UTF-8)
    done = False
    res.start = time.perf_counter()
    try:
        async with client.stream("POST", cfg.base_url + path, json=body) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {raw[:500]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("error"):
                    res.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return res
                if isinstance(chunk.get("usage"), dict):
                    res.usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                ch = choices[0]
                piece = ch.get("text") if cfg.endpoint == "completions" else (ch.get("delta") or {}).get("content")
                ntok = _chunk_token_count(ch)
                if ch.get("finish_reason"):
                    res.finish_reason = ch["finish_reason"]
                if piece:
                    if res.ttft is None:
                        res.ttft = now - res.start
                    res.chunk_times.append(now)
                    res.chunk_tokens.append(None if ntok is None else ntok + pending_tokens)
                    pending_tokens = 0
                    text_parts.append(piece)
                elif ntok:
                    pending_tokens += ntok
        res.latency = time.perf_counter() - res.start
        if pending_tokens and res.chunk_tokens and res.chunk_tokens[-1] is not None:
            res.chunk_tokens[-1] += pending_tokens  # type: ignore[operator]
        res.text = "".join(text_parts)
        # A finished stream without text is still a success (a first token that is EOS has no
        # text); it has no TTFT, and with ignore_eos the token check flags a short output.
        if done:
            res.success = True
        else:
            res.error = "stream ended without 'data: [DONE]'"
    except Exception as e:  # one bad request is a failed request, not a crashed benchmark
        res.latency = time.perf_counter() - res.start
        res.error = f"{type(e).__name__}: {e}"
    return res


# ---------------------------------------------------------------------------------------------
# Server-side information


async def get_json(client: httpx.AsyncClient, url: str) -> Any | None:
    try:
        r = await client.get(url, timeout=10.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def scrape_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, tuple[str, float]] | None:
    try:
        r = await client.get(base_url + "/metrics", timeout=10.0)
        if r.status_code != 200:
            return None
        return parse_prometheus(r.text)
    except (httpx.HTTPError, ValueError):
        return None


async def resolve_model_name(client: httpx.AsyncClient, cfg: BenchConfig) -> str:
    if cfg.model:
        return cfg.model
    models = await get_json(client, cfg.base_url + "/v1/models")
    try:
        return str(models["data"][0]["id"])
    except (TypeError, KeyError, IndexError):
        return "default"


def make_client(cfg: BenchConfig, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.request_timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4),
        headers=headers,
        trust_env=False,  # never send localhost traffic through an environment proxy
    )


# ---------------------------------------------------------------------------------------------
# Load shapes


def _progress(cfg: BenchConfig, total: int | None, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=cfg.disable_tqdm, unit="req", file=sys.stderr)


async def warmup(client: httpx.AsyncClient, cfg: BenchConfig, model: str, requests: list[BenchRequest]) -> None:
    n = cfg.warmup_requests
    if n == 0:
        return
    reqs = [requests[i % len(requests)] for i in range(n)]
    sem = asyncio.Semaphore(cfg.max_concurrency or n)

    async def one(i: int, r: BenchRequest) -> RequestResult:
        async with sem:
            return await send_request(client, cfg, model, -1 - i, r, min(r.output_len, cfg.warmup_output_len))

    results = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    if not any(r.success for r in results):
        raise RuntimeError(f"all {n} warmup requests to {cfg.base_url} failed; first error: {results[0].error}")


async def run_fixed(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, requests: list[BenchRequest]
) -> tuple[list[RequestResult], float, float]:
    """Send every request once: Poisson arrivals at cfg.request_rate, at most max_concurrency in flight."""
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    rng = np.random.default_rng(cfg.seed)
    gaps = rng.exponential(1.0 / cfg.request_rate, size=len(requests)) if math.isfinite(cfg.request_rate) else None
    pbar = _progress(cfg, len(requests), "requests")

    async def one(i: int, r: BenchRequest) -> RequestResult:
        if sem is None:
            res = await send_request(client, cfg, model, i, r)
        else:
            async with sem:
                res = await send_request(client, cfg, model, i, r)
        pbar.update(1)
        return res

    t0 = time.perf_counter()
    tasks = []
    arrival = 0.0
    for i, r in enumerate(requests):
        if gaps is not None and i > 0:
            arrival += float(gaps[i])
            delay = t0 + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, r)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    pbar.close()
    return results, t0, duration


class MetricsScraper:
    """Scrapes /metrics at t0 + k * window (k = 0, 1, ...) while a ramp runs."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, window_s: float):
        self.client, self.base_url, self.window_s = client, base_url, window_s
        self.snapshots: dict[int, dict[str, tuple[str, float]]] = {}
        self.t0 = 0.0
        self.task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        for k in itertools.count():
            delay = self.t0 + k * self.window_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            snap = await scrape_metrics(self.client, self.base_url)
            if snap is None:
                if k == 0:
                    return  # no /metrics: no server-side series
                continue
            self.snapshots[k] = snap

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.task = asyncio.create_task(self._loop())

    async def stop(self, schedule_end_s: float) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        if self.snapshots:  # close the schedule's last window if its scrape was missed
            last = math.ceil(schedule_end_s / self.window_s - 1e-6)
            if last not in self.snapshots:
                snap = await scrape_metrics(self.client, self.base_url)
                if snap is not None:
                    self.snapshots[last] = snap

    def between(self, t_a: float, t_b: float) -> dict[str, float | None] | None:
        """Speculation stats between the snapshots nearest to t_a and t_b (seconds from t0)."""
        ka, kb = round(t_a / self.window_s), round(t_b / self.window_s)
        a = self.snapshots.get(ka)
        b = self.snapshots.get(kb)
        if a is None or b is None or kb <= ka:
            return None
        return spec_from_metrics(metrics_delta(a, b))


async def run_ramp(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, requests: list[BenchRequest], ramp: RampSpec,
    start_at: float | None = None,
) -> tuple[list[RequestResult], float, float]:
    """Closed loop: worker w sends back-to-back requests while w < the current level. When the
    level drops, surplus workers finish their request in flight and then idle. The schedule starts
    at perf_counter() ``start_at`` (default: now)."""
    cond = asyncio.Condition()
    state = {"level": 0, "stop": False}
    counter = itertools.count()
    results: list[RequestResult] = []
    pbar = _progress(cfg, None, f"ramp {','.join(map(str, ramp.levels))}")

    async def worker(w: int) -> None:
        while True:
            async with cond:
                await cond.wait_for(lambda: state["stop"] or w < state["level"])
                if state["stop"]:
                    return
            i = next(counter)
            results.append(await send_request(client, cfg, model, i, requests[i % len(requests)]))
            pbar.update(1)

    t0 = time.perf_counter() if start_at is None else start_at
    if t0 > time.perf_counter():
        await asyncio.sleep(t0 - time.perf_counter())
    workers = [asyncio.create_task(worker(w)) for w in range(max(ramp.levels))]
    for j, level in enumerate(ramp.levels):
        async with cond:
            state["level"] = level
            cond.notify_all()
        delay = t0 + (j + 1) * ramp.step_duration_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    async with cond:
        state["stop"] = True
        cond.notify_all()
    await asyncio.gather(*workers)
    duration = time.perf_counter() - t0
    pbar.close()
    results.sort(key=lambda r: r.index)
    return results, t0, duration


# ---------------------------------------------------------------------------------------------
# A whole run


CLIENT_START_S = 0.3  # from handing the parts out to their common start (the processes are running)


async def run_benchmark(
    cfg: BenchConfig,
    requests: list[BenchRequest],
    tokenizer: BenchTokenizer | None = None,
    ramp: RampSpec | None = None,
    meta: dict[str, Any] | None = None,
    clients: ClientProcesses | None = None,
) -> dict[str, Any]:
    """Warm up, run (in ``clients``' processes where it splits over more than one), and return the
    result dict (the JSON the CLI writes)."""
    if not requests:
        raise ValueError("no requests to send")
    connections = max(ramp.levels) if ramp else (cfg.max_concurrency or len(requests))
    started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    async with make_client(cfg, connections) as client:
        model = await resolve_model_name(client, cfg)
        await warmup(client, cfg, model, requests)
        before = await scrape_metrics(client, cfg.base_url) if cfg.scrape_metrics else None
        scraper = None
        if ramp is not None and cfg.scrape_metrics:
            scraper = MetricsScraper(client, cfg.base_url, cfg.window_s)
        split = clients if clients is not None and clients.parts(cfg, requests, ramp) > 1 else None
        start_at = time.perf_counter() + (CLIENT_START_S if split is not None else 0.0)
        if scraper is not None:
            scraper.start(start_at)
        if split is not None:
            results, t0, duration = await asyncio.to_thread(split.run, cfg, model, requests, ramp, start_at)
        elif ramp is not None:
            results, t0, duration = await run_ramp(client, cfg, model, requests, ramp, start_at)
        else:
            results, t0, duration = await run_fixed(client, cfg, model, requests)
        if scraper is not None and ramp is not None:
            await scraper.stop(ramp.duration_s)
        after = await scrape_metrics(client, cfg.base_url) if before is not None else None
        info = await get_json(client, cfg.base_url + "/get_server_info")

    if tokenizer is not None:
        for r in results:
            if r.success:
                r.retokenized_len = len(tokenizer.encode(r.text))
    delta = metrics_delta(before, after) if before is not None and after is not None else None
    summary = summarize(results, duration, cfg.ignore_eos)
    spec_metrics = spec_from_metrics(delta)
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1

    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "ramp" if ramp else "fixed",
        "started_at": started_at,
        "command": command_line(),
        "model": model,
        "config": {**dataclasses.asdict(cfg), "api_key": "<set>" if cfg.api_key else None},
        "dataset": meta or {},
        **summary,
        "accept_length": {
            "server_info": server_info_accept_length(info),
            "usage": summary["spec_usage"]["accept_length"],
            "metrics": spec_metrics["accept_length"],
        },
        "spec_metrics": spec_metrics,
        "server_info": info,
        "server_metrics_delta": None if delta is None else spec_series(delta),
        "errors": [{"error": e, "count": n} for e, n in sorted(errors.items(), key=lambda x: -x[1])[:10]],
        "ramp": None,
        "requests": None,
    }
    if ramp is not None:
        result["ramp"] = {
            "levels": list(ramp.levels),
            "step_duration_s": ramp.step_duration_s,
            "window_s": cfg.window_s,
            "steps": ramp_steps(results, t0, ramp, scraper),
            # the series covers the schedule; requests still running when it ends (the drain)
            # count in the totals above but not in any window
            "windows": window_series(results, t0, ramp.duration_s, cfg.window_s, ramp.level_at, scraper),
            "drain_s": max(0.0, duration - ramp.duration_s),
        }
    if cfg.save_requests:
        result["requests"] = [r.to_json(t0, cfg.save_text) for r in results]
    return result


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, written the way a reader would retype it."""
    argv = list(sys.argv if argv is None else argv)
    name = Path(argv[0]).name if argv else ""
    rest = shlex.join(argv[1:])
    if name in ("specserve", "cli.py"):
        return f"specserve {rest}"
    if name in ("serving.py", "sweep.py", "plots.py"):
        return f"python -m specserve.bench.{name[:-3]} {rest}"
    return shlex.join(argv)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1, default=str) + "\n")
