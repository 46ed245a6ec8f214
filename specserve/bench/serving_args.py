"""`specserve bench serve` flags and entry point: argparse -> BenchConfig, requests, run_benchmark."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from specserve.bench.client_processes import ClientProcesses, default_client_processes
from specserve.bench.datasets import (
    BenchRequest,
    load_jsonl_requests,
    sample_random_requests,
    sample_sharegpt_requests,
)
from specserve.bench.ramp import RampSpec, expand_doubling, parse_int_list
from specserve.bench.serving import BenchConfig, command_line, run_benchmark, write_json
from specserve.bench.tokenizer import BenchTokenizer, resolve_tokenizer


def headline(result: dict[str, Any]) -> str:
    """One line for logs."""
    def f(x: Any, fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)

    return (
        f"completed {result['completed']}/{result['num_requests']}  out {f(result['output_throughput'])} tok/s  "
        f"TTFT {f(result['median_ttft_ms'])} ms  TPOT {f(result['mean_tpot_ms'])} ms  "
        f"accept {f(result['accept_length']['usage'] or result['accept_length']['server_info'], '.2f')}"
    )


def print_summary(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(x: Any, fmt: str = ",.2f") -> str:
        return "-" if x is None else format(x, fmt)

    t = Table(title=f"Serving benchmark: {result['model']} ({result['config']['endpoint']})", show_header=False)
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("completed / failed", f"{result['completed']} / {result['failed']}"),
        ("max concurrency", str(result["config"]["max_concurrency"] or "inf")),
        ("request rate", str(result["config"]["request_rate"])),
        ("duration (s)", f(result["duration_s"])),
        ("input / output tokens", f"{result['total_input_tokens']:,} / {result['total_output_tokens']:,}"),
        ("request throughput (req/s)", f(result["request_throughput"])),
        ("input throughput (tok/s)", f(result["input_throughput"])),
        ("output throughput (tok/s)", f(result["output_throughput"])),
        ("total throughput (tok/s)", f(result["total_token_throughput"])),
        ("mean concurrency", f(result["concurrency"])),
    ]
    for m, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "E2E latency")):
        vals = " / ".join(f(result[f"{s}_{m}_ms"], ",.1f") for s in ("mean", "median", "p90", "p99"))
        rows.append((f"{label} ms (mean/med/p90/p99)", vals))
    al = result["accept_length"]
    rows.append(("accept length (usage / server / metrics)",
                 " / ".join(f(al[k]) for k in ("usage", "server_info", "metrics"))))
    rows.append(("mean k (metrics)", f(result["spec_metrics"]["mean_k"])))
    tc = result["token_check"]
    rows.append(("tokens counted = received", "yes" if tc["consistent"] else f"NO {tc}"))
    for k, v in rows:
        t.add_row(k, v)
    console = Console(stderr=False)
    console.print(t)
    for e in result["errors"][:3]:
        console.print(f"[red]{e['count']} x {e['error']}[/red]")
    if result["ramp"]:
        rt = Table(title="ramp steps")
        for col in ("C", "t (s)", "out tok/s", "TPOT ms", "mean k", "accept"):
            rt.add_column(col, justify="right")
        for s in result["ramp"]["steps"]:
            rt.add_row(str(s["concurrency"]), f(s["t_start_s"], ".0f"), f(s["output_throughput"], ".1f"),
                       f(s["mean_tpot_ms"], ".1f"), f(s["mean_k"]), f(s["accept_length"]))
        console.print(rt)



# ---------------------------------------------------------------------------------------------
# CLI


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts")
    g.add_argument("--dataset", choices=("sharegpt", "random", "jsonl"), default="sharegpt")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--tokenizer", help="the server's tokenizer (model dir, tokenizer.json or .gguf); "
                   "default: --model if a local path, else what /get_server_info names")
    g.add_argument("--sharegpt-output-len", type=int, help="fixed output length instead of the reference reply's")
    g.add_argument("--sharegpt-max-output-len", type=int, help="clamp reply-derived output lengths")
    g.add_argument("--sharegpt-max-input-len", type=int, default=1024)
    g.add_argument("--sharegpt-max-total-len", type=int, default=2048)
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--jsonl-path", help='JSON lines: {"prompt": ..., "output_len": ...}')
    g.add_argument("--jsonl-output-len", type=int, help="output length for lines without one")
    g.add_argument("--seed", type=int, default=0)


def add_request_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests")
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    g.add_argument("--model", help="served model name (default: first of /v1/models); "
                   "also the tokenizer source when it is a local path")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                   help="send ignore_eos so every request generates exactly its output length")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    g.add_argument("--count-stream-tokens", action="store_true",
                   help="request per-token logprobs so the stream's token count can be checked against usage")
    g.add_argument("--warmup-requests", type=int, default=1)
    g.add_argument("--warmup-output-len", type=int, default=16)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    g.add_argument("--scrape-metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="read /metrics before/after (and per window in a ramp)")
    g.add_argument("--window", type=float, default=2.0, help="ramp series window, seconds")
    g.add_argument("--save-requests", action="store_true", help="per-request details in the JSON")
    g.add_argument("--save-text", action="store_true", help="with --save-requests: the generated text too")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--client-processes", type=int, default=0,
                   help="client processes sharing the streams (0: about one per 16 streams, up to 8, as the "
                        "machine's cores allow; one Python process parses ~25k stream events/s)")


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    add_dataset_args(p)
    add_request_args(p)
    g = p.add_argument_group("load")
    g.add_argument("--max-concurrency", type=int)
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf)")
    g.add_argument("--ramp", help="closed-loop concurrency levels over time, e.g. 1,8,32,8,1")
    g.add_argument("--ramp-step-duration", type=float, help="seconds per ramp level")
    g.add_argument("--ramp-duration", type=float, help="total ramp seconds, split evenly over the levels")
    g.add_argument("--ramp-doubling", action="store_true", help="fill in powers of two between the levels")
    p.add_argument("--output-file", help="write the JSON result here")
    p.add_argument("--quiet", action="store_true", help="no summary table")


def ramp_from_args(args: argparse.Namespace) -> RampSpec | None:
    if not getattr(args, "ramp", None):
        return None
    levels = parse_int_list(args.ramp)
    if args.ramp_doubling:
        levels = expand_doubling(levels)
    if (args.ramp_step_duration is None) == (args.ramp_duration is None):
        raise ValueError("--ramp needs exactly one of --ramp-step-duration or --ramp-duration")
    step = args.ramp_step_duration if args.ramp_step_duration is not None else args.ramp_duration / len(levels)
    if math.isfinite(getattr(args, "request_rate", math.inf)):
        raise ValueError("--request-rate does not apply to --ramp (a closed loop)")
    return RampSpec(tuple(levels), step)


def config_from_args(args: argparse.Namespace, base_url: str | None = None, **overrides: Any) -> BenchConfig:
    kw: dict[str, Any] = dict(
        base_url=base_url or args.base_url,
        endpoint=args.endpoint,
        model=args.model if args.model and not Path(args.model).exists() else None,
        max_concurrency=getattr(args, "max_concurrency", None),
        request_rate=getattr(args, "request_rate", math.inf),
        warmup_requests=args.warmup_requests,
        warmup_output_len=args.warmup_output_len,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        extra_body=args.extra_body,
        count_stream_tokens=args.count_stream_tokens,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key,
        scrape_metrics=args.scrape_metrics,
        window_s=args.window,
        save_requests=args.save_requests,
        save_text=args.save_text,
        disable_tqdm=args.disable_tqdm,
    )
    kw.update(overrides)
    return BenchConfig(**kw)


def tokenizer_from_args(args: argparse.Namespace, server_info: dict[str, Any] | None = None) -> BenchTokenizer | None:
    if args.tokenizer:
        from specserve.bench.tokenizer import load_tokenizer

        return load_tokenizer(args.tokenizer)
    info = server_info or {}
    cands = [args.model, info.get("model_path"), info.get("tokenizer_path"), info.get("served_model_name")]
    return resolve_tokenizer([c if isinstance(c, str) else None for c in cands])


def requests_from_args(
    args: argparse.Namespace, tokenizer: BenchTokenizer | None, num: int | None = None
) -> tuple[list[BenchRequest], dict[str, Any]]:
    n = num or args.num_prompts
    meta: dict[str, Any] = {"name": args.dataset, "num_prompts": n, "seed": args.seed,
                            "tokenizer": tokenizer.source if tokenizer else None}
    if args.dataset == "sharegpt":
        reqs = sample_sharegpt_requests(
            n, tokenizer, seed=args.seed, fixed_output_len=args.sharegpt_output_len,
            max_output_len=args.sharegpt_max_output_len, max_input_len=args.sharegpt_max_input_len,
            max_total_len=args.sharegpt_max_total_len,
        )
        meta.update(output_len=args.sharegpt_output_len, max_output_len=args.sharegpt_max_output_len)
    elif args.dataset == "random":
        reqs = sample_random_requests(n, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, tokenizer, seed=args.seed)
        meta.update(input_len=args.random_input_len, output_len=args.random_output_len,
                    range_ratio=args.random_range_ratio)
    else:
        if not args.jsonl_path:
            raise ValueError("--dataset jsonl needs --jsonl-path")
        reqs = load_jsonl_requests(args.jsonl_path, n, args.jsonl_output_len, tokenizer)
        meta.update(path=args.jsonl_path)
    return reqs, meta


def _server_info_sync(base_url: str) -> dict[str, Any] | None:
    try:
        r = httpx.get(base_url.rstrip("/") + "/get_server_info", timeout=10.0, trust_env=False)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def client_processes(args: argparse.Namespace, ramp: RampSpec | None, concurrency: int | None,
                     num_requests: int) -> ClientProcesses:
    """--client-processes, or enough for the most streams the load keeps open."""
    streams = max(ramp.levels) if ramp is not None else concurrency or num_requests
    return ClientProcesses(args.client_processes or default_client_processes(streams))


def main(args: argparse.Namespace) -> dict[str, Any]:
    ramp = ramp_from_args(args)
    cfg = config_from_args(args)
    tokenizer = tokenizer_from_args(args, _server_info_sync(cfg.base_url))
    requests, meta = requests_from_args(args, tokenizer)
    clients = client_processes(args, ramp, cfg.max_concurrency, len(requests))
    try:
        result = asyncio.run(run_benchmark(cfg, requests, tokenizer, ramp, meta, clients))
    finally:
        clients.close()
    result["command"] = command_line(getattr(args, "argv", None))
    if args.output_file:
        write_json(args.output_file, result)
    if not args.quiet:
        print_summary(result)
    return result


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench serve", description=__doc__.split("\n")[0])
    add_bench_serve_args(p)
    args = p.parse_args(argv)
    try:
        result = main(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(cli())
