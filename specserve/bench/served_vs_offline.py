"""Served vs offline: the same engine through `specserve serve` and in-process, at each concurrency.

    specserve bench served-vs-offline --model /tmp/m.gguf --speculative-draft-model-path HEAD \
        --concurrency 1,16,64,256 --configs no-spec,chain5,adaptive --output-dir out/

Per configuration, one server (engine core + front-ends, in a child process) and one in-process
engine with the same EngineConfig (and the same explicit KV size: both live on the device at
once). At each concurrency C both run the same chat prompts greedily as a closed loop of C
requests in flight (offline: a request is added when one finishes, as `LLM.chat` with
max_num_seqs=C); which side goes first alternates with C and round (--rounds). Metric definitions are the serving
client's (metrics.py): offline, a "chunk" is what a request gained in one engine step.
Writes served_vs_offline.json and served_vs_offline.png.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import multiprocessing
import os
import platform
import signal
import socket
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from specserve.bench.datasets import BenchRequest, sample_sharegpt_requests
from specserve.bench.metrics import RequestResult, summarize
from specserve.bench.serving import (
    BenchConfig,
    command_line,
    make_client,
    parse_int_list,
    resolve_model_name,
    run_fixed,
    warmup as warmup_requests,
    write_json,
)

CONFIGS = {
    "no-spec": None,
    "chain5": dict(num_steps=5, eagle_topk=1, policy="static"),  # a static chain of 5 drafts
    "adaptive": dict(policy="adaptive"),  # the default policy
}
HEADLINE = ("output_throughput", "median_ttft_ms", "mean_tpot_ms", "median_itl_ms")


def load_requests(args: Any, tokenizer: Any) -> list[BenchRequest]:
    """ShareGPT's first turns, or ``--prompts-file`` (JSON: a list of prompts, or {"prompts": [...]})."""
    if not args.prompts_file:
        return sample_sharegpt_requests(args.num_prompts, tokenizer, seed=args.seed,
                                        fixed_output_len=args.output_len, max_input_len=args.max_input_len)
    with open(args.prompts_file) as f:
        data = json.load(f)
    prompts = data["prompts"] if isinstance(data, dict) else data
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{args.prompts_file}: expected a JSON list of prompt strings (or {{'prompts': [...]}})")
    out = []
    for p in prompts:
        n = len(tokenizer.encode(p))
        if 4 <= n <= args.max_input_len:
            out.append(BenchRequest(prompt=p, output_len=args.output_len, prompt_len=n))
        if len(out) == args.num_prompts:
            return out
    raise ValueError(f"{args.prompts_file} holds {len(out)} prompts of 4..{args.max_input_len} tokens; "
                     f"--num-prompts asks for {args.num_prompts}")


def engine_config(base: Any, name: str, draft_path: str | None) -> Any:
    from specserve.config import SpeculativeConfig, replace

    spec = CONFIGS[name]
    if spec is None:
        return replace(base, speculative=None)
    if draft_path is None:
        raise SystemExit(f"config {name!r} needs an EAGLE-3 head: pass --speculative-draft-model-path")
    return replace(base, speculative=SpeculativeConfig(draft_model_path=draft_path, **spec))


# ---------------------------------------------------------------- offline


def run_offline(engine: Any, prompts: list[list[int]], max_tokens: list[int], concurrency: int,
                temperature: float = 0.0) -> tuple[list[RequestResult], float, float]:
    """Closed loop of ``concurrency`` requests in flight; (results, duration s, mean step s)."""
    from specserve.sampling_params import RequestOutputKind, SamplingParams

    results = [RequestResult(index=i, expected_output_len=n, client_prompt_len=len(p))
               for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    index: dict[str, int] = {}
    next_i, steps, step_time = 0, 0, 0.0
    t0 = time.perf_counter()
    while next_i < len(prompts) or index:
        while next_i < len(prompts) and len(index) < concurrency:
            rid = f"offline-{concurrency}-{next_i}"
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens[next_i],
                                    output_kind=RequestOutputKind.DELTA)
            results[next_i].start = time.perf_counter()
            engine.add_request(rid, prompts[next_i], params)
            index[rid] = next_i
            next_i += 1
        s0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps, step_time = steps + 1, step_time + (now - s0)
        for out in outs:
            r = results[index[out.request_id]]
            n = len(out.new_token_ids)
            if n:
                if r.ttft is None:
                    r.ttft = now - r.start
                r.chunk_times.append(now)
                r.chunk_tokens.append(n)
            if out.finished:
                del index[out.request_id]
                m = out.metrics
                r.latency, r.success, r.finish_reason = now - r.start, True, out.outputs[0].finish_reason
                r.usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": sum(r.chunk_tokens),
                           "spec_verify_steps": m.spec_verify_steps, "spec_draft_tokens": m.spec_draft_tokens,
                           "spec_accepted_tokens": m.spec_accepted_tokens}
    return results, time.perf_counter() - t0, step_time / max(steps, 1)


# ---------------------------------------------------------------- served


def _serve_child(ns: argparse.Namespace, config: Any) -> None:
    from specserve.server.launch import build_engine, run_server

    sys.exit(run_server(ns, partial(build_engine, config)))


class ServerProcess:
    """`specserve serve` for one EngineConfig, in a child process (its own engine core and front-ends)."""

    def __init__(self, config: Any, api_server_count: int, stream_interval: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        from specserve.server.args import add_serve_args

        ns = add_serve_args(argparse.ArgumentParser()).parse_args(
            ["--host", "127.0.0.1", "--port", str(port), "--api-server-count", str(api_server_count),
             "--stream-interval", str(stream_interval), "--shutdown-timeout", "5", "--uvicorn-log-level", "warning"])
        self.url = f"http://127.0.0.1:{port}"
        self.proc = multiprocessing.get_context("spawn").Process(target=_serve_child, args=(ns, config))
        self.proc.start()

    def wait_ready(self, timeout: float = 1800.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.is_alive():
                raise RuntimeError(f"the server exited during start-up (code {self.proc.exitcode})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def _served(url: str, requests: list[BenchRequest], concurrency: int, warm_up: bool) -> Any:
    cfg = BenchConfig(base_url=url, endpoint="chat", max_concurrency=concurrency, warmup_requests=len(requests),
                      warmup_output_len=8, scrape_metrics=False, disable_tqdm=True, temperature=0.0)

    async def go() -> Any:
        async with make_client(cfg, concurrency) as client:
            model = await resolve_model_name(client, cfg)
            if warm_up:
                return await warmup_requests(client, cfg, model, requests)
            results, _, duration = await run_fixed(client, cfg, model, requests)
            return results, duration

    return asyncio.run(go())


def _served_part(url: str, requests: list[BenchRequest], concurrency: int) -> tuple[list[RequestResult], float, float]:
    """One client process's share of a served run: (results, wall start, wall end)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    start = time.time()
    results, _ = _served(url, requests, concurrency, warm_up=False)
    return results, start, time.time()


class ServedClients:
    """The serving client's closed loop of C streams, split over ``processes`` processes (one Python
    process parses ~25k SSE events/s: at high C it, not the server, would set the pace)."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self.pool = multiprocessing.get_context("spawn").Pool(processes) if processes > 1 else None

    def run(self, url: str, requests: list[BenchRequest], concurrency: int) -> tuple[list[RequestResult], float]:
        """(results, duration s): process i runs requests[i::P] with its share of the C streams."""
        p = max(1, min(self.processes, concurrency, len(requests)))
        if p == 1 or self.pool is None:
            return _served(url, requests, concurrency, warm_up=False)
        conc = [concurrency // p + (i < concurrency % p) for i in range(p)]
        parts = self.pool.starmap(_served_part, [(url, requests[i::p], conc[i]) for i in range(p)])
        results = [r for part, _, _ in parts for r in part]
        return results, max(end for _, _, end in parts) - min(start for _, start, _ in parts)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()


def default_client_processes(concurrency: int) -> int:
    """Enough client processes for ~16 streams each, leaving the server two cores and one each."""
    return max(1, min(8, concurrency // 16, ((os.cpu_count() or 2) - 2) // 2))


def warm_up_server(url: str, requests: list[BenchRequest]) -> None:
    """Short requests, all at once."""
    _served(url, requests, len(requests), warm_up=True)


# ---------------------------------------------------------------- the run


def prompts_for(concurrency: int, args: argparse.Namespace) -> int:
    """Requests run at this concurrency: enough for a steady state (the prompts cycle), not 480 one at a time."""
    return min(args.max_requests, max(args.min_prompts, args.prompts_per_concurrency * concurrency))


def _headline(summary: dict[str, Any]) -> dict[str, Any]:
    keys = ("completed", "failed", "duration_s", "total_output_tokens", "output_throughput", "request_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms")
    out = {k: summary.get(k) for k in keys}
    out["accept_length"] = summary.get("spec_usage", {}).get("accept_length")
    return out


def _device_name(device: Any) -> str:
    import torch

    if getattr(device, "type", None) == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from specserve.config import replace
    from specserve.engine.args import engine_config_from_args
    from specserve.engine.engine import LLMEngine

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    concurrencies = parse_int_list(args.concurrency)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    base = engine_config_from_args(args, default_speculative=False)
    draft_path = args.speculative_draft_model_path
    if draft_path is None and args.model is None and any(CONFIGS[n] for n in names):
        from specserve.config import default_draft_path

        draft_path = default_draft_path()
    num_blocks = args.num_kv_blocks or max(concurrencies) * math.ceil(
        (args.max_input_len + args.output_len) / base.block_size) + 64
    base = replace(base, max_num_seqs=max(concurrencies), num_kv_blocks=num_blocks,
                   max_waiting_requests=max(args.max_requests, base.max_waiting_requests))

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": command_line(getattr(args, "argv", None)),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "concurrency": concurrencies, "configs": names, "num_prompts": args.num_prompts,
        "output_len": args.output_len, "api_server_count": args.api_server_count,
        "stream_interval": args.stream_interval, "num_kv_blocks": num_blocks, "runs": [],
    }
    procs = args.client_processes or default_client_processes(max(concurrencies))
    result["client_processes"] = procs
    clients = ServedClients(procs)
    tokenizer = None
    for name in names:
        config = engine_config(base, name, draft_path)
        server = ServerProcess(config, args.api_server_count, args.stream_interval)  # loads meanwhile
        engine = None
        try:
            engine = LLMEngine(config)
            if tokenizer is None:
                tokenizer = engine.tokenizer
                requests = load_requests(args, tokenizer)
                result["device"] = _device_name(engine.device)
                result["dtype"] = str(engine.dtype).replace("torch.", "")
                result["model"] = engine.model_name
                result["torch"] = torch.__version__
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": r.prompt}],
                                                            add_generation_prompt=True) for r in requests]
            max_tokens = [r.output_len for r in requests]
            server.wait_ready()
            if args.warmup:
                run_offline(engine, prompts[: args.warmup], [8] * min(args.warmup, len(prompts)), args.warmup)
                warm_up_server(server.url, requests[: args.warmup])
            for ci, c in enumerate(concurrencies):
                n = prompts_for(c, args)
                parts = [[i % len(prompts) for i in range(n)[r :: args.rounds]] for r in range(args.rounds)]
                sides: dict[str, list] = {"offline": [[], 0.0, 0.0], "served": [[], 0.0, 0.0]}
                for ri, part in enumerate(parts):  # rounds alternate which side goes first
                    order = ("offline", "served") if (ci + ri) % 2 == 0 else ("served", "offline")
                    for side in order:
                        if side == "offline":
                            res, duration, step_s = run_offline(engine, [prompts[i] for i in part],
                                                                [max_tokens[i] for i in part], c)
                        else:
                            res, duration = clients.run(server.url, [requests[i] for i in part], c)
                            step_s = 0.0
                        acc = sides[side]
                        acc[0] += res
                        acc[1] += duration
                        acc[2] += step_s * duration
                run: dict[str, Any] = {"config": name, "concurrency": c, "num_prompts": n, "rounds": args.rounds}
                for side, (res, duration, _) in sides.items():
                    run[side] = _headline(summarize(res, duration, False))
                _, off_duration, off_step_weighted = sides["offline"]
                run["offline"]["mean_step_ms"] = off_step_weighted / off_duration * 1e3
                off, srv = run["offline"]["output_throughput"], run["served"]["output_throughput"]
                run["served_over_offline"] = srv / off if off and srv else None
                result["runs"].append(run)
                print(f"{name:>9} C={c:<4} offline {off or 0:9.1f} tok/s  served {srv or 0:9.1f} tok/s  "
                      f"ratio {run['served_over_offline'] or 0:.3f}", flush=True)
                write_json(out_dir / "served_vs_offline.json", result)
        finally:
            server.stop()
            engine = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    clients.close()
    write_json(out_dir / "served_vs_offline.json", result)
    plot(result, out_dir / "served_vs_offline.png")
    print(f"wrote {out_dir / 'served_vs_offline.json'} and {out_dir / 'served_vs_offline.png'}")
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_throughput", "output tok/s"), (None, "served / offline tok/s"),
              ("median_ttft_ms", "median TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"),
              ("median_itl_ms", "median ITL (ms)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ci, name in enumerate(result["configs"]):
        runs = [r for r in result["runs"] if r["config"] == name]
        cs = [r["concurrency"] for r in runs]
        color = colors[ci % len(colors)]
        for ax, (key, label) in zip(axes, panels):
            if key is None:
                ax.plot(cs, [r["served_over_offline"] for r in runs], "o-", color=color, label=name)
                ax.axhline(1.0, color="grey", lw=0.8)
            else:
                ax.plot(cs, [r["offline"][key] for r in runs], "o--", color=color, label=f"{name} offline")
                ax.plot(cs, [r["served"][key] for r in runs], "s-", color=color, label=f"{name} served")
            ax.set_title(label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"served vs offline: {result.get('model')} {result.get('dtype')} on {result.get('device')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_args(p: argparse.ArgumentParser) -> None:
    from specserve.engine.args import add_engine_args

    add_engine_args(p)
    g = p.add_argument_group("served vs offline")
    g.add_argument("--concurrency", default="1,16,64,256", help="comma-separated concurrencies")
    g.add_argument("--configs", default="no-spec,chain5,adaptive", help=f"comma-separated, of {', '.join(CONFIGS)}")
    g.add_argument("--num-prompts", type=int, default=480, help="ShareGPT chat prompts (the most a run takes)")
    g.add_argument("--prompts-file", default=None,
                   help="JSON list of prompts instead of ShareGPT (e.g. benchmarks/data/sharegpt_prompts_seed0.json)")
    g.add_argument("--prompts-per-concurrency", type=int, default=8,
                   help="a run at concurrency C takes min(max-requests, max(min-prompts, this x C)) requests")
    g.add_argument("--min-prompts", type=int, default=64)
    g.add_argument("--max-requests", type=int, default=2048,
                   help="most requests a run takes (the prompts repeat past --num-prompts)")
    g.add_argument("--output-len", type=int, default=256, help="max_tokens per request (natural stops end earlier)")
    g.add_argument("--max-input-len", type=int, default=1024, help="longest prompt, in tokens")
    g.add_argument("--warmup", type=int, default=8, help="short requests through each side before measuring")
    g.add_argument("--rounds", type=int, default=1,
                   help="split the prompts into this many rounds, offline and served alternating within each "
                        "concurrency (finer interleaving where the machine drifts; each round should hold >= C prompts)")
    g.add_argument("--api-server-count", type=int, default=1)
    g.add_argument("--stream-interval", type=int, default=1)
    g.add_argument("--client-processes", type=int, default=0,
                   help="client processes sharing the C streams (0: about one per 16 streams, up to 8, as the "
                        "machine's cores allow)")
    g.add_argument("--output-dir", default=".", help="where served_vs_offline.json / .png go")
