"""Concurrency sweeps over server configurations: one command per BENCHMARKS.md table.

    specserve bench sweep --model M \
        --config none='--speculative-algorithm NONE' \
        --config static='--speculative-algorithm EAGLE3 --speculative-policy static' \
        --config adaptive='--speculative-algorithm EAGLE3 --speculative-policy adaptive' \
        --concurrency 1,2,4,8,16,32 --dataset sharegpt --sharegpt-output-len 128 --ignore-eos \
        --output-dir benchmarks/results/adaptive

For each configuration the server is started here (a subprocess on a free port, its log in the
output directory), waited for on /health, loaded at each concurrency in turn (the same prompts
for every configuration) and always stopped afterwards. With ``--ramp`` each configuration runs
one ramp instead, compared window by window with the first configuration and with the best of the
others (sweep.json's ramp_comparison). The client's streams split over processes as in `bench serve`.
Writes sweep.json (rewritten after every run, so a long sweep keeps what it has), sweep.md (the
tables and the command) and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from specserve.bench.ramp import parse_int_list
from specserve.bench.serving import command_line, run_benchmark, write_json
from specserve.bench.serving_args import (add_dataset_args, add_request_args, client_processes, config_from_args,
                                          headline, ramp_from_args, requests_from_args)
from specserve.bench.tokenizer import BenchTokenizer, default_model_path, load_tokenizer

SCHEMA_VERSION = 1
DEFAULT_SERVER_CMD = "{python} -m specserve.cli serve --host {host} --port {port}"


@dataclass(frozen=True)
class ServerConfig:
    name: str
    flags: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> "ServerConfig":
        """``NAME=flags`` (the flags may be empty: the server's defaults)."""
        name, sep, flags = text.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--config wants NAME='server flags', got {text!r}")
        if not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError(f"config name {name!r}: use letters, digits, '-', '_' or '.'")
        return cls(name, tuple(shlex.split(flags)))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(template: str, flags: tuple[str, ...], host: str, port: int, model: str | None) -> list[str]:
    """The template's placeholders ({python}, {host}, {port}, {model}) filled in, flags appended.
    ``--model`` is appended too when the template has no {model} and a model was given."""
    if "{port}" not in template:
        raise ValueError(f"--server-cmd must contain {{port}}, got {template!r}")
    if "{model}" in template and not model:
        raise ValueError("--server-cmd uses {model} but no --model was given")
    cmd = [part.format(python=sys.executable, host=host, port=port, model=model or "")
           for part in shlex.split(template)]
    if model and "{model}" not in template:
        cmd += ["--model", model]
    return cmd + list(flags)


class ServerStartError(RuntimeError):
    pass


def _tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


class ServerProcess:
    """A server subprocess in its own process group; ``with`` waits for /health and always stops it."""

    def __init__(self, cmd: list[str], base_url: str, log_path: Path, start_timeout_s: float,
                 env: dict[str, str] | None = None):
        self.cmd, self.base_url, self.log_path = cmd, base_url, log_path
        self.start_timeout_s = start_timeout_s
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(("$ " + shlex.join(self.cmd) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, **(self.env or {})})
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerStartError(
                    f"server exited with status {rc} before /health answered; log {self.log_path}:\n"
                    f"{_tail(self.log_path)}")
            try:
                r = httpx.get(self.base_url + "/health", timeout=2.0, trust_env=False)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"server not healthy after {self.start_timeout_s:.0f} s; log {self.log_path}:\n"
                    f"{_tail(self.log_path)}")
            time.sleep(0.5)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the server's process group, SIGKILL if it lingers."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def prompts_for(c: int, per_c: int, lo: int, hi: int) -> int:
    """Prompts to send at concurrency c: per_c rounds of c, clamped to [lo, hi] but never below c."""
    return max(c, min(hi, max(lo, per_c * c)))


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep")
    g.add_argument("--config", action="append", required=True, metavar="NAME='FLAGS'",
                   help="a server configuration (repeatable); the first one is the baseline of the ratios")
    g.add_argument("--concurrency", default="1,2,4,8", help="comma-separated max-concurrency values")
    g.add_argument("--prompts-per-concurrency", type=int, default=4,
                   help="prompts at concurrency C: this many times C, clamped to --min/--max-prompts")
    g.add_argument("--min-prompts", type=int, default=8)
    g.add_argument("--max-prompts", type=int, default=256)
    g.add_argument("--ramp", help="run one ramp per configuration instead (levels, e.g. 1,32,1)")
    g.add_argument("--ramp-step-duration", type=float)
    g.add_argument("--ramp-duration", type=float)
    g.add_argument("--ramp-doubling", action="store_true")
    g.add_argument("--server-cmd", default=DEFAULT_SERVER_CMD,
                   help="server command template; {python} {host} {port} {model} are filled in and the "
                   "configuration's flags appended")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--server-start-timeout", type=float, default=900.0)
    g.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the server processes (repeatable)")
    g.add_argument("--output-dir", help="default: benchmarks/results/sweep-<UTC time>")
    g.add_argument("--no-plots", action="store_true")
    add_dataset_args(p)
    add_request_args(p)
    # --model means the engine model here: it goes to the server command and is the tokenizer source
    for a in p._actions:
        if a.dest == "model":
            a.help = "model for the servers (GGUF or HF dir; default: the server's default model)"
    p.set_defaults(num_prompts=None)


def _tokenizer(args: argparse.Namespace) -> BenchTokenizer | None:
    src = args.tokenizer or args.model or default_model_path()
    if src is None or not Path(src).exists():
        return None
    return load_tokenizer(src)


def _slim(result: dict[str, Any]) -> dict[str, Any]:
    """A run's result without what repeats across runs (server_info is kept once per configuration)."""
    return {k: v for k, v in result.items() if k not in ("server_info", "command", "config", "dataset")}


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    configs = [ServerConfig.parse(c) for c in args.config]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must be unique, got {names}")
    concurrency = parse_int_list(args.concurrency)
    if any(c < 1 for c in concurrency):
        raise ValueError(f"concurrency values must be >= 1, got {concurrency}")
    ramp = ramp_from_args(args)
    env = dict(kv.split("=", 1) for kv in args.server_env)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.output_dir or f"benchmarks/results/sweep-{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _tokenizer(args)
    if ramp is not None:
        n_max = args.num_prompts or args.max_prompts
    else:
        n_max = max(prompts_for(c, args.prompts_per_concurrency, args.min_prompts, args.max_prompts)
                    for c in concurrency)
    all_requests, meta = requests_from_args(args, tokenizer, num=n_max)

    sweep: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "ramp" if ramp else "sweep",
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(getattr(args, "argv", None)),
        "model": args.model,
        "configs": {c.name: shlex.join(c.flags) for c in configs},
        "baseline": configs[0].name,
        "concurrency": concurrency,
        "ramp": None if ramp is None else {"levels": list(ramp.levels), "step_duration_s": ramp.step_duration_s},
        "dataset": meta,
        "bench_config": None,
        "server_info": {},
        "runs": [],
        "errors": {},
    }

    def save() -> None:
        write_json(out_dir / "sweep.json", sweep)

    clients = client_processes(args, ramp, max(concurrency), len(all_requests))
    sweep["client_processes"] = clients.processes
    try:
        for sc in configs:
            port = free_port(args.host)
            base_url = f"http://{args.host}:{port}"
            cmd = server_command(args.server_cmd, sc.flags, args.host, port, args.model)
            print(f"[{sc.name}] starting: {shlex.join(cmd)}", file=sys.stderr)
            try:
                with ServerProcess(cmd, base_url, out_dir / f"server-{sc.name}.log", args.server_start_timeout,
                                   env) as srv:
                    loads: list[int | None] = [None] if ramp is not None else list(concurrency)
                    for i, c in enumerate(loads):
                        n = len(all_requests) if c is None else prompts_for(
                            c, args.prompts_per_concurrency, args.min_prompts, args.max_prompts)
                        cfg = config_from_args(args, base_url=base_url, model=None, max_concurrency=c,
                                               request_rate=math.inf,
                                               warmup_requests=args.warmup_requests if i == 0 else 0)
                        sweep["bench_config"] = {k: v for k, v in cfg.__dict__.items()
                                                 if k not in ("base_url", "api_key")}
                        result = asyncio.run(run_benchmark(cfg, all_requests[:n], tokenizer, ramp, meta, clients))
                        sweep["server_info"][sc.name] = result["server_info"]
                        sweep["runs"].append({"config": sc.name, "concurrency": c, "num_prompts": n,
                                              "result": _slim(result)})
                        print(f"[{sc.name}] C={c if c is not None else 'ramp'}: {headline(result)}", file=sys.stderr)
                        save()
                        if not srv.alive:
                            raise ServerStartError(f"server exited during the run; log {srv.log_path}:\n"
                                                   f"{_tail(srv.log_path)}")
            except (ServerStartError, RuntimeError, OSError, httpx.HTTPError) as e:
                sweep["errors"][sc.name] = f"{type(e).__name__}: {e}"
                print(f"[{sc.name}] failed: {e}", file=sys.stderr)
                save()
    finally:
        clients.close()

    from specserve.bench.plots import plot_all, ramp_comparison, sweep_markdown

    if ramp is not None:
        sweep["ramp_comparison"] = ramp_comparison(sweep)
    md = sweep_markdown(sweep)
    (out_dir / "sweep.md").write_text(md)
    if not args.no_plots:
        sweep["plots"] = [str(p) for p in plot_all(sweep, out_dir)]
    save()
    print(md)
    print(f"wrote {out_dir / 'sweep.json'}", file=sys.stderr)
    return sweep


def main(args: argparse.Namespace) -> dict[str, Any]:
    return _with_sigterm_as_exit(run_sweep, args)


def _with_sigterm_as_exit(fn: Any, *a: Any) -> Any:
    """SIGTERM raises SystemExit so the `with ServerProcess` blocks stop their servers."""
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return fn(*a)
    try:
        return fn(*a)
    finally:
        signal.signal(signal.SIGTERM, old)


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench sweep", description=__doc__.split("\n")[0])
    add_sweep_args(p)
    args = p.parse_args(argv)
    try:
        sweep = main(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if sweep["errors"] else 0


if __name__ == "__main__":
    sys.exit(cli())
