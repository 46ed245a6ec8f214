"""Running the server: the engine core process, front-end processes (uvicorn), the supervisor and its signals.

    specserve serve                     # main(): engine core + --api-server-count front-ends
    with serve_in_thread(factory) as s:  # tests: the core in its own process, uvicorn in a thread
        ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

from fastapi import FastAPI
import prometheus_client
import uvicorn

from specserve.server.api import ServerState, build_app
from specserve.server.args import DEFAULT_KEEP_ALIVE_S, DEFAULT_MAX_REQUEST_BYTES, check_serve_args
from specserve.server.client import DataParallelClient, EngineClient, connect
from specserve.server.engine_core import CoreAddresses, build_engine, run_engine_core, shutdown_engine_core

log = logging.getLogger(__name__)


GRACEFUL_CLOSE_S = 5  # after the drain: time for the last chunks to reach their clients


def _spawn() -> multiprocessing.context.SpawnContext:
    # spawn: a fork would copy the caller's threads' locks (torch's pools, uvicorn's loop) mid-use
    return multiprocessing.get_context("spawn")


def start_engine_core(engine_factory: Callable[[], Any], num_frontends: int = 1, log_level: int = logging.INFO,
                      env: dict[str, str] | None = None, name: str = "specserve-engine-core",
                      ) -> tuple[multiprocessing.process.BaseProcess, CoreAddresses]:
    """Start the engine-core process; ``engine_factory`` (picklable) builds the engine in it."""
    addresses = CoreAddresses.new(num_frontends)
    proc = _spawn().Process(target=run_engine_core, args=(engine_factory, addresses, os.getpid(), log_level, env),
                            name=name, daemon=True)
    proc.start()
    return proc, addresses


def start_engine_cores(engine_factory: Callable[[], Any], num_frontends: int, data_parallel_size: int,
                       gpus_per_replica: int, log_level: int = logging.INFO,
                       ) -> list[tuple[multiprocessing.process.BaseProcess, CoreAddresses]]:
    """``data_parallel_size`` engine cores; with CUDA devices each replica sees its own
    ``gpus_per_replica`` of them (CUDA_VISIBLE_DEVICES), in order (0: CPU engines)."""
    if data_parallel_size == 1:
        return [start_engine_core(engine_factory, num_frontends, log_level)]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise SystemExit("--data-parallel-size > 1 under torchrun: its ranks form one replica; start replicas apart")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    import torch

    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    gpus = gpus if gpus_per_replica else []
    if gpus and len(gpus) < data_parallel_size * gpus_per_replica:
        raise SystemExit(f"{data_parallel_size} replicas of {gpus_per_replica} GPU(s) need "
                         f"{data_parallel_size * gpus_per_replica} GPUs; {len(gpus)} visible")
    cores = []
    for i in range(data_parallel_size):
        mine = gpus[i * gpus_per_replica : (i + 1) * gpus_per_replica]
        env = {"CUDA_VISIBLE_DEVICES": ",".join(mine)} if mine else None
        cores.append(start_engine_core(engine_factory, num_frontends, log_level, env, f"specserve-engine-core-{i}"))
    return cores


@dataclasses.dataclass
class LocalServer:
    """A server started by serve_in_thread: its URL, app and engine-core process."""

    url: str
    app: FastAPI
    core: multiprocessing.process.BaseProcess  # (data parallel: the first replica's; all in ``cores``)
    cores: list[multiprocessing.process.BaseProcess] = dataclasses.field(default_factory=list)

    @property
    def client(self) -> EngineClient | DataParallelClient:
        return self.app.state.server.client

    def on_engine(self, fn: str | Callable[..., Any], *args: Any) -> Any:
        """Run an engine method (by name) or a picklable fn(engine, *args) in the core, between steps."""
        return self.client.call_threadsafe(fn, *args)


@contextlib.contextmanager
def serve_in_thread(engine_factory: Callable[[], Any], served_model_name: str | list[str] | None = None,
                    api_key: str | None = None, stream_interval: int = 1, host: str = "127.0.0.1",
                    port: int = 0, startup_timeout: float = 120.0,
                    timeout_keep_alive: int = DEFAULT_KEEP_ALIVE_S,
                    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, data_parallel_size: int = 1,
                    gpus_per_replica: int = 1) -> Iterator[LocalServer]:
    """An engine-core process (``data_parallel_size`` of them, see start_engine_cores) and one front-end in
    a uvicorn thread (tests, tools); stops them on exit."""
    cores = start_engine_cores(engine_factory, 1, data_parallel_size, gpus_per_replica, logging.WARNING)
    core = cores[0][0]
    client = connect([a for _, a in cores], 0, [p.pid for p, _ in cores], stream_interval)
    app = build_app(client, served_model_name, api_key, startup_timeout, max_request_bytes)
    sock = _bind(host, port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                            timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
                                            timeout_keep_alive=timeout_keep_alive))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="specserve-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (engine core exit code {core.exitcode})")
            time.sleep(0.01)
        yield LocalServer(f"http://{host}:{port}", app, core, [p for p, _ in cores])
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        for proc, addresses in cores:
            shutdown_engine_core(proc, addresses)


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(args: argparse.Namespace) -> None:
    """`specserve serve`."""
    import functools

    from specserve.engine.args import engine_config_from_args

    check_serve_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config_from_args(args)
    sys.exit(run_server(args, functools.partial(build_engine, config)))


def run_server(args: argparse.Namespace, engine_factory: Callable[[], Any]) -> int:
    """Supervise an engine core and ``args.api_server_count`` front-ends until they stop; the exit code.

    SIGTERM/SIGINT: the front-ends drain (shutdown_timeout), then the core stops: 0. The core dies:
    the front-ends answer 503, exit non-zero, and so does this."""
    check_serve_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = _bind(args.host, args.port)
    n = args.api_server_count
    gpus = 0 if getattr(args, "device", "auto") == "cpu" else getattr(args, "tensor_parallel_size", 1)
    cores = start_engine_cores(engine_factory, n, args.data_parallel_size, gpus)
    metrics_dir = None
    if n > 1:  # the front-ends' metrics go to files that each one's /metrics sums
        metrics_dir = tempfile.mkdtemp(prefix="specserve-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    api_key = args.api_key if args.api_key is not None else os.environ.get("SPECSERVE_API_KEY") or None
    opts = FrontendOptions(args.served_model_name, api_key, args.stream_interval, args.shutdown_timeout,
                           args.enable_access_log, args.timeout_keep_alive, args.uvicorn_log_level,
                           args.max_request_bytes)
    addresses, pids = [a for _, a in cores], [p.pid for p, _ in cores]
    fronts = [_spawn().Process(target=run_frontend, args=(opts, addresses, i, pids, sock), name=f"specserve-api-{i}")
              for i in range(n)]
    for f in fronts:
        f.start()
    sock.close()  # the front-ends have their own copies
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            for f in fronts:  # each drains (a terminal's Ctrl-C reached them already; once is enough)
                if f.pid is not None and f.is_alive():
                    os.kill(f.pid, signal.SIGTERM)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    log.info("serving on http://%s:%d: engine core pid(s) %s, %d front-end(s)", args.host, args.port,
             ", ".join(str(p.pid) for p, _ in cores), n)
    failed = False
    while any(f.is_alive() for f in fronts):
        multiprocessing.connection.wait([f.sentinel for f in fronts], timeout=1.0)
        if any(f.exitcode not in (None, 0) for f in fronts) and not failed:
            failed = True  # one front-end failed (the core died, or it did): stop the others
            for f in fronts:
                if f.is_alive():
                    os.kill(f.pid, signal.SIGTERM)
    core_died = any(p.exitcode is not None for p, _ in cores)
    for proc, addresses in cores:
        shutdown_engine_core(proc, addresses)
    if metrics_dir is not None:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    code = 1 if failed or core_died else 0
    log.info("server stopped%s", "" if code == 0 else " after a failure")
    return code


@dataclasses.dataclass(frozen=True)
class FrontendOptions:
    served_model_name: list[str] | None
    api_key: str | None
    stream_interval: int
    shutdown_timeout: float
    enable_access_log: bool
    timeout_keep_alive: int
    log_level: str
    max_request_bytes: int


def run_frontend(opts: FrontendOptions, addresses: list[CoreAddresses], index: int, core_pids: list[int],
                 sock: socket.socket) -> None:
    """Entry point of a front-end process: serve until drained (exit 0) or a core dies (exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prometheus_client.disable_created_metrics()  # no *_created series next to every counter
    client = connect(addresses, index, core_pids, opts.stream_interval)
    app = build_app(client, opts.served_model_name, opts.api_key, max_request_bytes=opts.max_request_bytes)
    srv: ServerState = app.state.server
    config = uvicorn.Config(app, log_level=opts.log_level, access_log=opts.enable_access_log,
                            timeout_graceful_shutdown=GRACEFUL_CLOSE_S, timeout_keep_alive=opts.timeout_keep_alive)
    server = _DrainingServer(config, srv, opts.shutdown_timeout)

    def on_dead() -> None:  # answer what is in flight (503), then go: the supervisor stops the rest
        server.should_exit = True

    client.on_dead = on_dead
    server.run(sockets=[sock])
    sys.exit(1 if client.error is not None else 0)


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM/SIGINT drains the front-end (ServerState.drain) before it exits."""

    def __init__(self, config: uvicorn.Config, srv: ServerState, timeout: float) -> None:
        super().__init__(config)
        self.srv, self.timeout, self.draining = srv, timeout, False

    def handle_exit(self, sig: int, frame: Any) -> None:
        # not uvicorn's: it would stop at once and re-raise the signal after (exit code -15)
        if not self.started or self.srv.loop is None:
            os._exit(0)  # still starting: nothing in flight
        if not self.draining:
            self.draining = True
            self.srv.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        await self.srv.drain(self.timeout)
        self.should_exit = True
