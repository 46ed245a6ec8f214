"""Served vs offline: the same engine through `specserve serve` and stepped directly, at each concurrency.

    specserve bench served-vs-offline --model /tmp/m.gguf --speculative-draft-model-path HEAD \
        --concurrency 1,16,64,256 --configs no-spec,chain5,adaptive --output-dir out/

Per configuration, two processes with the same EngineConfig (and the same explicit KV size: both live
on the device at once), each set up as an engine core sets itself up: a server (engine core +
front-ends, in a child process) and the offline side (bench/offline.py: the engine stepped in a
process of its own). This process holds no engine: it sends the prompts, runs the serving client
(split over client processes at high C) and keeps the results. At each concurrency C both sides
run the same chat prompts greedily as a closed loop of C requests in flight (offline: a request is
added when one finishes, as `LLM.chat` with max_num_seqs=C); which side goes first alternates with
C and round (--rounds). Metric definitions are the serving client's (metrics.py): offline, a
"chunk" is what a request gained in one engine step. The offline side also reports its mean step
time at the steady batch, next to the served TPOT. Writes served_vs_offline.json and .png.

With fixed configurations beside ``adaptive`` (``--configs no-spec,chain3,chain5,chain7,tree,adaptive``) the
result also holds, per side and concurrency, the adaptive engine's tok/s over the best fixed one's
(``versus_best``). ``--sides offline`` starts no server: every configuration's offline process is started
first (one at a time), then at each concurrency every round runs the configurations in turn, the order
rotating, so that drift hits them alike while each engine keeps a process of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from specserve.bench.client_processes import ClientProcesses, default_client_processes
from specserve.bench.datasets import BenchRequest, sample_sharegpt_requests
from specserve.bench.metrics import summarize
from specserve.bench.offline import OfflineProcess, StepStats
from specserve.bench.ramp import parse_int_list
from specserve.bench.serving import (
    BenchConfig,
    command_line,
    make_client,
    resolve_model_name,
    warmup as warmup_requests,
    write_json,
)

CONFIG_NAMES = "no-spec, chain<k> (a static chain of k drafts), tree (static, 5 steps x top-4, 16 tokens), " \
    "tree<n> (the same with n tokens), adaptive (the default policy and shape), adaptive<k> (drafting at most k), " \
    "either adaptive one with policy fields: adaptive:clip=1.5+margin=0.01 (AdaptivePolicyConfig)"
SIDES = ("offline", "served")


def spec_for(name: str) -> dict[str, Any] | None:
    """SpeculativeConfig fields of a configuration name (None: no speculation); ValueError for others."""
    shape, _, fields = name.partition(":")
    if fields:  # adaptive[<k>]:field=value+field=value
        from specserve.config import AdaptivePolicyConfig

        spec = spec_for(shape)
        if spec is None or spec["policy"] != "adaptive":
            raise ValueError(f"unknown config {name!r}: policy fields go on an adaptive config; one of: {CONFIG_NAMES}")
        policy = {}
        for item in fields.split("+"):
            key, _, value = item.partition("=")
            try:
                policy[key.strip()] = int(value) if value.strip().isdigit() else float(value)
            except ValueError:
                raise ValueError(f"config {name!r}: want field=number, got {item!r}") from None
        AdaptivePolicyConfig.from_dict(policy)  # (unknown fields and bad values: a clear error now)
        return spec | {"adaptive": policy}
    if name == "no-spec":
        return None
    if name == "adaptive":
        return dict(policy="adaptive")
    for prefix, build in (("chain", lambda n: dict(num_steps=n, eagle_topk=1, policy="static")),
                          ("tree", lambda n: dict(num_steps=5, eagle_topk=4, num_draft_tokens=n, policy="static")),
                          ("adaptive", lambda n: dict(policy="adaptive", num_steps=n))):
        if name.startswith(prefix):
            rest = name[len(prefix):] or ("16" if prefix == "tree" else "")
            if rest.isdigit() and int(rest) >= 1:
                return build(int(rest))
    raise ValueError(f"unknown config {name!r}; one of: {CONFIG_NAMES}")


def versus_best(runs: list[dict[str, Any]], side: str) -> list[dict[str, Any]]:
    """Per concurrency: the best fixed configuration's tok/s on ``side`` and the adaptive engine's over it."""
    out = []
    for c in sorted({r["concurrency"] for r in runs}):
        tok = {r["config"]: r[side]["output_throughput"] for r in runs
               if r["concurrency"] == c and side in r and r[side]["output_throughput"]}
        fixed = {n: v for n, v in tok.items() if not n.startswith("adaptive")}  # adaptive<k>: variants
        if "adaptive" not in tok or not fixed:
            continue
        best = max(fixed, key=fixed.__getitem__)
        rounds = {r["config"]: r[side].get("rounds_tok_s") or [] for r in runs
                  if r["concurrency"] == c and r["config"] in ("adaptive", best)}
        per_round = [a / b for a, b in zip(rounds["adaptive"], rounds[best]) if a and b]  # same prompts a round
        out.append({"concurrency": c, "best_fixed": best, "best_fixed_tok_s": fixed[best],
                    "adaptive_tok_s": tok["adaptive"], "adaptive_over_best": tok["adaptive"] / fixed[best],
                    "rounds_adaptive_over_best": per_round or None,
                    "over_no_spec": {n: v / tok["no-spec"] for n, v in tok.items()} if "no-spec" in tok else None})
    return out


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

    spec = spec_for(name)
    if spec is None:
        return replace(base, speculative=None)
    if draft_path is None:
        raise SystemExit(f"config {name!r} needs an EAGLE-3 head: pass --speculative-draft-model-path")
    return replace(base, speculative=SpeculativeConfig(draft_model_path=draft_path, **spec))


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


def served_config(url: str, concurrency: int, ignore_eos: bool) -> BenchConfig:
    return BenchConfig(base_url=url, endpoint="chat", max_concurrency=concurrency, scrape_metrics=False,
                       disable_tqdm=True, temperature=0.0, ignore_eos=ignore_eos)


def warm_up_server(url: str, requests: list[BenchRequest]) -> str:
    """Short requests, all at once; the served model's name."""
    cfg = dataclasses.replace(served_config(url, max(1, len(requests)), False), warmup_requests=len(requests),
                              warmup_output_len=8)

    async def go() -> str:
        async with make_client(cfg, len(requests)) as client:
            model = await resolve_model_name(client, cfg)
            await warmup_requests(client, cfg, model, requests)
            return model

    return asyncio.run(go())


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


def _offline_steps(stats: list[StepStats]) -> dict[str, Any]:
    """The offline engine's steps over a run's rounds; mean step time at the steady batch (all C in flight)."""
    steady = sum(s.steady_steps for s in stats)
    total_ms = sum(s.mean_step_ms * s.steady_steps for s in stats if s.mean_step_ms is not None)
    k_counts = sum((Counter(s.k_counts or {}) for s in stats), Counter())
    decisions = sum(k_counts.values())
    paths = sum((Counter(s.path_counts or {}) for s in stats), Counter())
    explored = [s.explorations for s in stats if s.explorations is not None]
    by_batch: dict[int, dict[str, list[float]]] = {}
    for s in stats:
        for batch, kinds in (s.by_batch or {}).items():
            for kind, (n, secs, tokens) in kinds.items():
                row = by_batch.setdefault(batch, {}).setdefault(kind, [0, 0.0, 0])
                row[0], row[1], row[2] = row[0] + n, row[1] + secs, row[2] + tokens
    table = next((s.goodput for s in reversed(stats) if s.goodput is not None), None)
    if table is not None:  # the last round's table, every round's pick changes
        table = table | {"pick_changes": [c | {"round": i} for i, s in enumerate(stats)
                                          for c in (s.goodput or {}).get("pick_changes") or []]}
    return {"steps": sum(s.steps for s in stats), "steady_steps": steady,
            "mean_step_ms": total_ms / steady if steady else None, "k_counts": dict(sorted(k_counts.items())) or None,
            "mean_k": sum(k * n for k, n in k_counts.items()) / decisions if decisions else None,
            "path_counts": dict(sorted(paths.items())) or None, "explorations": sum(explored) if explored else None,
            "by_batch": {b: {kind: {"steps": n, "seconds": round(secs, 4), "tokens": tokens}
                             for kind, (n, secs, tokens) in sorted(kinds.items())}
                         for b, kinds in sorted(by_batch.items())} or None,
            "goodput_table": table}


def start_offline(name: str, config: Any, args: argparse.Namespace, result: dict[str, Any],
                  requests: list[BenchRequest]) -> tuple[OfflineProcess, list[BenchRequest]]:
    """``config``'s offline engine started and warmed up; its start-up in ``result``; the requests (loaded with
    its tokenizer if not yet)."""
    t_start = time.monotonic()
    side = OfflineProcess(config, reserved_cores=args.api_server_count)
    try:
        info = side.wait_ready()
        if not requests:
            requests = load_requests(args, info["tokenizer"])
            result.update(device=info["device"], dtype=info["dtype"], model=info["model"], torch=info["torch"])
        result["start_up"][name] = {"offline_s": time.monotonic() - t_start, "offline_pid": info["pid"],
                                    "offline_cpu_threads": info["cpu_threads"], "calibration": info["calibration"]}
        warm = requests[: args.warmup]
        if warm:
            side.run([r.prompt for r in warm], [8] * len(warm), len(warm))
    except BaseException:
        side.stop()
        raise
    return side, requests


def main(args: argparse.Namespace) -> dict[str, Any]:
    from specserve.config import replace
    from specserve.engine.args import engine_config_from_args

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    concurrencies = parse_int_list(args.concurrency)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    try:
        specs = {n: spec_for(n) for n in names}
    except ValueError as e:
        raise SystemExit(str(e)) from None
    sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    if "offline" not in sides or any(x not in SIDES for x in sides) or len(set(sides)) < len(sides):
        raise SystemExit(f"--sides takes offline or offline,served (the served side is measured against the "
                         f"offline one), got {args.sides!r}")
    try:
        base = engine_config_from_args(args, default_speculative=False)
    except ValueError as e:
        raise SystemExit(f"served-vs-offline: {e} (the configurations' own speculation is set by --configs)") from None
    draft_path = args.speculative_draft_model_path
    if draft_path is None and args.model is None and any(specs.values()):
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
        "concurrency": concurrencies, "configs": names, "sides": sides, "num_prompts": args.num_prompts,
        "output_len": args.output_len, "ignore_eos": args.ignore_eos, "api_server_count": args.api_server_count,
        "stream_interval": args.stream_interval, "num_kv_blocks": num_blocks, "start_up": {}, "runs": [],
    }
    served = "served" in sides
    procs = (args.client_processes or default_client_processes(max(concurrencies))) if served else 0
    result["client_processes"] = procs
    configs = {name: engine_config(base, name, draft_path) for name in names}
    if not served:
        interleaved_offline(args, configs, concurrencies, result, out_dir)
        return finish(result, out_dir)
    clients = ClientProcesses(procs)
    requests: list[BenchRequest] = []
    for name, config in configs.items():
        # the offline engine first, then the server's: two starting at once would time their start-up cost
        # profiles against each other (now the second reuses the profile the first cached)
        offline, requests = start_offline(name, config, args, result, requests)
        server = None
        try:
            t_served = time.monotonic()
            server = ServerProcess(config, args.api_server_count, args.stream_interval)
            server.wait_ready()
            result["start_up"][name]["served_s"] = time.monotonic() - t_served
            model = warm_up_server(server.url, requests[: args.warmup])
            for ci, c in enumerate(concurrencies):
                n = prompts_for(c, args)
                parts = [[i % len(requests) for i in range(n)[r :: args.rounds]] for r in range(args.rounds)]
                got: dict[str, list] = {side: [[], 0.0] for side in sides}
                steps: list[StepStats] = []
                per_round: list[float | None] = []
                for ri, part in enumerate(parts):  # rounds alternate which side goes first
                    reqs = [requests[i] for i in part]
                    for side in sides if (ci + ri) % 2 == 0 else sides[::-1]:
                        if side == "offline":
                            res, duration, st = offline.run([r.prompt for r in reqs], [r.output_len for r in reqs],
                                                            c, args.ignore_eos)
                            steps.append(st)
                            per_round.append(summarize(res, duration, args.ignore_eos)["output_throughput"])
                        else:
                            res, _, duration = clients.run(served_config(server.url, c, args.ignore_eos), model, reqs)
                        got[side][0] += res
                        got[side][1] += duration
                run: dict[str, Any] = {"config": name, "concurrency": c, "num_prompts": n, "rounds": args.rounds}
                for side, (res, duration) in got.items():
                    run[side] = _headline(summarize(res, duration, args.ignore_eos))
                run["offline"].update(_offline_steps(steps), rounds_tok_s=per_round)
                off, srv = run["offline"]["output_throughput"], run["served"]["output_throughput"]
                run["served_over_offline"] = srv / off if off and srv else None
                step_ms, tpot = run["offline"]["mean_step_ms"], run["served"]["mean_tpot_ms"]
                run["served_tpot_over_offline_step"] = tpot / step_ms if tpot and step_ms else None
                result["runs"].append(run)
                print(f"{name:>9} C={c:<4} offline {off or 0:9.1f} tok/s  served {srv or 0:9.1f} tok/s  "
                      f"ratio {run['served_over_offline'] or 0:.3f}  offline step {step_ms or 0:.2f} ms  "
                      f"served TPOT {tpot or 0:.2f} ms", flush=True)
                write_json(out_dir / "served_vs_offline.json", result)
        finally:
            if server is not None:
                server.stop()
            offline.stop()
    clients.close()
    return finish(result, out_dir)


def interleaved_offline(args: argparse.Namespace, configs: dict[str, Any], concurrencies: list[int],
                        result: dict[str, Any], out_dir: Path) -> None:
    """The offline side alone: every configuration's engine in a process of its own, all started first (one at a
    time), then at each concurrency each round runs every configuration in turn, the order rotating."""
    names = list(configs)
    procs: dict[str, OfflineProcess] = {}
    requests: list[BenchRequest] = []
    try:
        for name, config in configs.items():
            procs[name], requests = start_offline(name, config, args, result, requests)
        for ci, c in enumerate(concurrencies):
            n = prompts_for(c, args)
            results: dict[str, list] = {name: [] for name in names}
            seconds = dict.fromkeys(names, 0.0)
            steps: dict[str, list[StepStats]] = {name: [] for name in names}
            per_round: dict[str, list[float | None]] = {name: [] for name in names}
            for ri in range(args.rounds):
                reqs = [requests[i % len(requests)] for i in range(n)[ri :: args.rounds]]
                k = (ci + ri) % len(names)
                for name in names[k:] + names[:k]:
                    res, duration, st = procs[name].run([r.prompt for r in reqs], [r.output_len for r in reqs], c,
                                                        args.ignore_eos)
                    results[name] += res
                    seconds[name] += duration
                    steps[name].append(st)
                    per_round[name].append(summarize(res, duration, args.ignore_eos)["output_throughput"])
            for name in names:
                run = {"config": name, "concurrency": c, "num_prompts": n, "rounds": args.rounds,
                       "offline": _headline(summarize(results[name], seconds[name], args.ignore_eos))}
                run["offline"].update(_offline_steps(steps[name]), rounds_tok_s=per_round[name])
                result["runs"].append(run)
                print(f"{name:>9} C={c:<4} offline {run['offline']['output_throughput'] or 0:9.1f} tok/s", flush=True)
            write_json(out_dir / "served_vs_offline.json", result)
    finally:
        for side in procs.values():
            side.stop()


def finish(result: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The adaptive engine against the best fixed configuration; the JSON, the table and the plot written."""
    result["versus_best"] = {side: versus_best(result["runs"], side) for side in result["sides"]}
    write_json(out_dir / "served_vs_offline.json", result)
    print(versus_best_table(result))
    print(by_batch_lines(result))
    plot(result, out_dir / "served_vs_offline.png")
    print(f"wrote {out_dir / 'served_vs_offline.json'} and {out_dir / 'served_vs_offline.png'}")
    return result


def versus_best_table(result: dict[str, Any]) -> str:
    """Markdown: output tok/s per configuration and concurrency (x no-spec), the adaptive engine over the best
    fixed configuration, per side."""
    lines = []
    for side in result.get("sides", SIDES):
        rows = {v["concurrency"]: v for v in result.get("versus_best", {}).get(side, [])}
        if not rows:
            continue
        names = result["configs"]
        lines += [f"{side}, output tok/s (x no-spec):", "",
                  "| C | " + " | ".join(names) + " | adaptive / best fixed (best) | per round |",
                  "|--:|" + "--:|" * len(names) + "--:|--:|"]
        for c, v in sorted(rows.items()):
            tok = {r["config"]: r[side]["output_throughput"] for r in result["runs"] if r["concurrency"] == c}
            x = v["over_no_spec"] or {}
            cells = [f"{tok[n]:,.0f}" + (f" ({x[n]:.2f}x)" if n in x else "") if tok.get(n) else "-" for n in names]
            per = " ".join(f"{r:.3f}" for r in v.get("rounds_adaptive_over_best") or []) or "-"
            lines.append(f"| {c} | " + " | ".join(cells) + f" | {v['adaptive_over_best']:.3f} ({v['best_fixed']}) "
                         f"| {per} |")
        lines.append("")
    return "\n".join(lines)


def by_batch_lines(result: dict[str, Any]) -> str:
    """Per offline run of no-spec and the adaptive engines: its steps by batch and kind (steps x ms a step), e.g.
    ``C=64 adaptive: 64 plain 2200 x 1.52 verify 150 x 5.01 switch 20 x 2.03 | 45 plain 80 x 1.31``."""
    lines = []
    for r in result["runs"]:
        bb = (r.get("offline") or {}).get("by_batch")
        if not bb or not (r["config"] == "no-spec" or r["config"].startswith("adaptive")):
            continue
        cells = []
        for batch, kinds in sorted(bb.items(), key=lambda kv: -int(kv[0])):
            cells.append(f"{batch} " + " ".join(f"{kind} {v['steps']} x {1e3 * v['seconds'] / v['steps']:.2f}"
                                                for kind, v in kinds.items()))
        lines.append(f"C={r['concurrency']} {r['config']}: " + " | ".join(cells))
    return "\n".join(["offline steps by batch (steps x ms a step):"] + lines) if lines else ""


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = result.get("sides", SIDES)
    panels = [("output_throughput", "output tok/s")] + ([(None, "served / offline tok/s")] if "served" in sides else [])
    panels += [("median_ttft_ms", "median TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"), ("median_itl_ms", "median ITL (ms)")]
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
                for side, style in (("offline", "o--"), ("served", "s-")):
                    if side in sides:
                        ax.plot(cs, [r[side][key] for r in runs], style, color=color, label=f"{name} {side}")
            ax.set_title(label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{' vs '.join(sides)}: {result.get('model')} {result.get('dtype')} on {result.get('device')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_args(p: argparse.ArgumentParser) -> None:
    from specserve.engine.args import add_engine_args

    add_engine_args(p)
    g = p.add_argument_group("served vs offline")
    g.add_argument("--concurrency", default="1,16,64,256", help="comma-separated concurrencies")
    g.add_argument("--configs", default="no-spec,chain5,adaptive", help=f"comma-separated, of: {CONFIG_NAMES}")
    g.add_argument("--sides", default="offline,served",
                   help="offline,served, or offline alone: no server, every configuration's engine started first "
                        "and the configurations run in turn at each concurrency and round, the order rotating")
    g.add_argument("--num-prompts", type=int, default=480, help="ShareGPT chat prompts (the most a run takes)")
    g.add_argument("--prompts-file", default=None,
                   help="JSON list of prompts instead of ShareGPT (e.g. benchmarks/data/sharegpt_prompts_seed0.json)")
    g.add_argument("--prompts-per-concurrency", type=int, default=8,
                   help="a run at concurrency C takes min(max-requests, max(min-prompts, this x C)) requests")
    g.add_argument("--min-prompts", type=int, default=64)
    g.add_argument("--max-requests", type=int, default=2048,
                   help="most requests a run takes (the prompts repeat past --num-prompts)")
    g.add_argument("--output-len", type=int, default=256, help="max_tokens per request (natural stops end earlier)")
    g.add_argument("--ignore-eos", action="store_true", help="every request generates --output-len tokens (both sides)")
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
