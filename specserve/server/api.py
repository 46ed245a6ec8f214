"""OpenAI-compatible HTTP front-end (FastAPI + uvicorn) of an engine-core process.

    specserve serve                     # main(): engine core + --api-server-count front-ends
    with serve_in_thread(factory) as s:  # tests: the core in its own process, uvicorn in a thread
        ...

The front-end tokenizes, applies the chat template, sends token ids to the engine core
(engine_core.py), and turns the ids it gets back into text and SSE chunks (client.py).
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
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Callable

from fastapi import FastAPI, Request
import msgspec
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
import uvicorn
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.sampling_params import SamplingParams
from specserve.server import protocol as P
from specserve.server.client import EngineClient, EngineDeadError, RequestRejected, RequestState
from specserve.server.engine_core import CoreAddresses, run_engine_core, shutdown_engine_core
from specserve.server.metrics import ServerMetrics, avg_accept_length

log = logging.getLogger(__name__)

QUEUE_FULL_RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, err_type: str, code: str | None = None,
        param: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type
        self.code, self.param, self.headers = code, param, headers


def _error(status: int, message: str, err_type: str, code: Any = None, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, err_type, code, param), status_code=status, headers=headers)


def _format_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    parts, param = [], None
    for err in errors:
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", err.get("msg", ""))
            return f"Request body is not valid JSON: {reason}", None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        msg = err.get("msg", "invalid value")
        if err.get("type") == "missing":
            msg = "field required"
        parts.append(f"{where}: {msg}")
    return "Invalid request: " + "; ".join(parts), param


class _Server:
    """State shared by the route handlers of one front-end."""

    def __init__(self, client: EngineClient, served_model_names: list[str] | None, api_key: str | None) -> None:
        self.client = client
        self.requested_names = served_model_names
        self.model_names: list[str] = []
        self.api_key = api_key
        self.metrics: ServerMetrics | None = None
        self.tokenizer: Any = None
        self.accepting = True  # False once shutting down: new requests get 503
        self.started = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def info(self) -> Any:
        return self.client.info

    def check_model(self, requested: str | None) -> None:
        if requested is None or requested == "default" or requested in self.model_names:
            return
        raise ApiError(
            404, f"The model `{requested}` does not exist. Served: {', '.join(self.model_names)}",
            "NotFoundError", "model_not_found", "model",
        )

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     arrival: float) -> RequestState:
        if not self.accepting:
            raise ApiError(503, "The server is shutting down.", "ServiceUnavailableError")
        try:
            return await self.client.add_request(request_id, prompt_ids, params, arrival)
        except EngineDeadError as e:
            raise ApiError(503, f"The engine is not running: {e}", "ServiceUnavailableError") from e
        except RequestRejected as e:
            if e.status == 503:
                raise ApiError(
                    503, f"Server overloaded: the waiting queue is full ({e}). Retry later.",
                    "ServiceUnavailableError", "queue_full",
                    headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
                ) from e
            if e.status == 400:  # the engine's verdict on the input (lengths, token ids, ...)
                raise ApiError(400, str(e), "BadRequestError", "invalid_request") from e
            raise ApiError(e.status, str(e), "InternalServerError") from e

    async def drain(self, timeout: float) -> None:
        """Stop admission, let requests in flight finish for up to ``timeout`` s, abort the rest."""
        self.accepting = False
        client = self.client
        log.info("shutting down: %d requests in flight, waiting up to %.0f s", client.num_in_flight, timeout)
        deadline = time.monotonic() + timeout
        while client.num_in_flight and time.monotonic() < deadline and client.is_alive:
            await asyncio.sleep(0.02)
        n = client.abort_all()
        if n:
            log.info("aborted %d requests still running after %.0f s", n, timeout)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(srv: _Server, state: RequestState, request: Request) -> bool:
    """Wait for a non-streaming request to finish; False if the client went away first (aborted)."""
    task = asyncio.ensure_future(state.result())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            try:
                task.result()
            except EngineDeadError as e:
                raise ApiError(503, f"The engine stopped: {e}", "ServiceUnavailableError") from e
            return True
        return False
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        srv.client.abort(state.request_id)  # a no-op once finished


_json = msgspec.json.Encoder()


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(client: EngineClient, served_model_name: str | list[str] | None = None,
              api_key: str | None = None, startup_timeout: float = 3600.0) -> FastAPI:
    """The FastAPI app of one front-end; it connects to the engine core on start-up (lifespan)."""
    names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
    srv = _Server(client, names, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        srv.loop = asyncio.get_running_loop()
        info = await client.start(startup_timeout)
        srv.tokenizer = info.tokenizer
        srv.model_names = list(srv.requested_names or []) or [info.model_name]
        srv.metrics = client.metrics = ServerMetrics(srv.model_names[0], engine_stats=client.client_index == 0)
        try:
            yield
        finally:
            client.close()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.server = srv

    # ------------------------------------------------------------ errors

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.err_type, exc.code, exc.param, exc.headers)

    @app.exception_handler(P.BadRequest)
    async def _bad_request(request: Request, exc: P.BadRequest) -> JSONResponse:
        return _error(400, str(exc), "BadRequestError", "invalid_request", exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _format_validation_errors(list(exc.errors()))
        return _error(400, message, "BadRequestError", "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return _error(exc.status_code, str(exc.detail), err_type, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return _error(500, f"Internal server error: {type(exc).__name__}: {exc}", "InternalServerError")

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        if srv.api_key is not None and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), srv.api_key):
                return _error(401, "Missing or invalid API key (send `Authorization: Bearer <key>`).",
                              "AuthenticationError", "invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    # ------------------------------------------------------------ info endpoints

    @app.get("/health")
    async def health() -> Response:
        if client.is_alive and srv.accepting:
            return JSONResponse({"status": "ok"})
        why = "shutting down" if client.is_alive else f"engine is not running: {client.error}"
        return _error(503, why, "ServiceUnavailableError")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [
            {"id": name, "object": "model", "created": srv.started, "owned_by": "specserve",
             "root": getattr(srv.info.config, "model", None) or name, "max_model_len": srv.info.max_model_len}
            for name in srv.model_names
        ]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        stats = client.stats
        state = {k: ({str(i): v for i, v in sorted(x.items())} if isinstance(x, dict) else x)
                 for k, x in vars(stats).items()} if stats is not None else {}
        accept = avg_accept_length(stats)
        if accept is not None:  # absent without speculation, as SGLang does
            state["avg_spec_accept_length"] = accept
        state["last_gen_throughput"] = srv.metrics.last_gen_throughput()
        cfg = srv.info.config
        spec = getattr(cfg, "speculative", None)
        return jsonable_encoder({
            "served_model_name": srv.model_name,
            "model_path": getattr(cfg, "model", None),
            "max_model_len": srv.info.max_model_len,
            "speculative_algorithm": getattr(spec, "algorithm", None),
            "engine_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None,
            "engine_core_pid": srv.info.core_pid,
            "internal_states": [state],
        })

    # ------------------------------------------------------------ chat

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        srv.check_model(body.model)
        params = body.to_sampling_params()
        try:
            prompt_ids = srv.tokenizer.apply_chat_template(body.chat_messages(), add_generation_prompt=True)
        except Exception as e:  # a template may refuse a message sequence (roles, order)
            raise P.BadRequest(f"Could not apply the chat template to these messages: {e}", "messages") from e
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created, model = P.now(), body.model or srv.model_name
        top_n = body.top_logprobs or 0
        state = await srv.submit(request_id, list(prompt_ids), params, arrival)

        if body.stream:
            gen = _chat_stream(srv, state, created, model, top_n, body.include_usage)
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS,
                                     background=BackgroundTask(client.abort, request_id))
        if not await _collect(srv, state, request):
            return Response(status_code=499)  # client closed the request; nobody reads this
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": state.text},
            "logprobs": (P.chat_logprobs(srv.tokenizer, state.token_ids, state.logprobs, top_n)
                         if state.logprobs is not None else None),
            "finish_reason": state.finish_reason,
            "stop_reason": state.stop_reason,
        }
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": P.usage_dict(state),
        })

    # ------------------------------------------------------------ completions

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        srv.check_model(body.model)
        params = body.to_sampling_params()
        prompt = body.single_prompt()
        if body.echo and body.logprobs is not None:
            raise P.BadRequest("echo with logprobs is not supported (no prompt logprobs)", "echo")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created, model = P.now(), body.model or srv.model_name
        top_n = body.logprobs or 0
        prompt_ids = srv.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        state = await srv.submit(request_id, prompt_ids, params, arrival)
        echo_text = "" if not body.echo else (prompt if isinstance(prompt, str) else srv.tokenizer.decode(prompt))

        if body.stream:
            gen = _completion_stream(srv, state, created, model, top_n, body.include_usage, echo_text)
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS,
                                     background=BackgroundTask(client.abort, request_id))
        if not await _collect(srv, state, request):
            return Response(status_code=499)
        logprobs = None
        if state.logprobs is not None:
            logprobs = P.completion_logprobs(srv.tokenizer, state.token_ids, state.logprobs, top_n, len(echo_text))
        choice = {"index": 0, "text": echo_text + state.text, "logprobs": logprobs,
                  "finish_reason": state.finish_reason, "stop_reason": state.stop_reason}
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": P.usage_dict(state),
        })

    return app


# ---------------------------------------------------------------- SSE generators


async def _chat_stream(srv: _Server, state: RequestState, created: int, model: str, top_n: int,
                       include_usage: bool) -> AsyncIterator[bytes]:
    request_id = state.request_id

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
              stop_reason: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        obj = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return obj

    try:
        first = True
        while True:
            text, ids, lps, last = await state.next_chunk()
            if first:  # sent with the first output, so a client's time-to-first-chunk is a real TTFT
                yield _sse(chunk({"role": "assistant", "content": ""}))
                first = False
            logprobs = P.chat_logprobs(srv.tokenizer, ids, lps, top_n) if lps and ids else None
            delta = {"content": text} if text else {}
            if last:
                yield _sse(chunk(delta, state.finish_reason, logprobs, state.stop_reason))
                break
            if delta or logprobs:
                yield _sse(chunk(delta, None, logprobs))
        if include_usage:
            yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": P.usage_dict(state)})
    except EngineDeadError as e:
        yield _sse(P.error_body(f"The engine stopped: {e}", "ServiceUnavailableError", 503))
    except Exception as e:
        log.exception("stream %s failed", request_id)
        yield _sse(P.error_body(f"Internal server error: {type(e).__name__}: {e}", "InternalServerError", 500))
    finally:
        srv.client.abort(request_id)  # frees its KV blocks when the client went away mid-stream
    yield b"data: [DONE]\n\n"


async def _completion_stream(srv: _Server, state: RequestState, created: int, model: str, top_n: int,
                             include_usage: bool, echo_text: str) -> AsyncIterator[bytes]:
    request_id = state.request_id

    def chunk(text: str, finish: str | None = None, logprobs: Any = None, stop_reason: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        obj = {"id": request_id, "object": "text_completion", "created": created, "model": model,
               "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return obj

    try:
        if echo_text:
            yield _sse(chunk(echo_text))
        offset = len(echo_text)
        while True:
            text, ids, lps, last = await state.next_chunk()
            logprobs = P.completion_logprobs(srv.tokenizer, ids, lps, top_n, offset) if lps and ids else None
            offset += len(text)
            if last:
                yield _sse(chunk(text, state.finish_reason, logprobs, state.stop_reason))
                break
            if text or logprobs:
                yield _sse(chunk(text, None, logprobs))
        if include_usage:
            yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": P.usage_dict(state)})
    except EngineDeadError as e:
        yield _sse(P.error_body(f"The engine stopped: {e}", "ServiceUnavailableError", 503))
    except Exception as e:
        log.exception("stream %s failed", request_id)
        yield _sse(P.error_body(f"Internal server error: {type(e).__name__}: {e}", "InternalServerError", 500))
    finally:
        srv.client.abort(request_id)
    yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------- running it


# Longer than the idle expiry of common HTTP client pools (httpx and the openai client: 5 s). With equal
# timeouts the server may close an idle connection just as the client reuses it: connection reset.
DEFAULT_KEEP_ALIVE_S = 30
GRACEFUL_CLOSE_S = 5  # after the drain: time for the last chunks to reach their clients


def _spawn() -> multiprocessing.context.SpawnContext:
    # spawn: a fork would copy the caller's threads' locks (torch's pools, uvicorn's loop) mid-use
    return multiprocessing.get_context("spawn")


def start_engine_core(engine_factory: Callable[[], Any], num_frontends: int = 1,
                      log_level: int = logging.INFO) -> tuple[multiprocessing.process.BaseProcess, CoreAddresses]:
    """Start the engine-core process; ``engine_factory`` (picklable) builds the engine in it."""
    addresses = CoreAddresses.new(num_frontends)
    proc = _spawn().Process(target=run_engine_core, args=(engine_factory, addresses, os.getpid(), log_level),
                            name="specserve-engine-core", daemon=True)
    proc.start()
    return proc, addresses


@dataclasses.dataclass
class LocalServer:
    """A server started by serve_in_thread: its URL, app and engine-core process."""

    url: str
    app: FastAPI
    core: multiprocessing.process.BaseProcess

    @property
    def client(self) -> EngineClient:
        return self.app.state.server.client

    def on_engine(self, fn: str | Callable[..., Any], *args: Any) -> Any:
        """Run an engine method (by name) or a picklable fn(engine, *args) in the core, between steps."""
        return self.client.call_threadsafe(fn, *args)


@contextlib.contextmanager
def serve_in_thread(engine_factory: Callable[[], Any], served_model_name: str | list[str] | None = None,
                    api_key: str | None = None, stream_interval: int = 1, host: str = "127.0.0.1",
                    port: int = 0, startup_timeout: float = 120.0,
                    timeout_keep_alive: int = DEFAULT_KEEP_ALIVE_S) -> Iterator[LocalServer]:
    """An engine-core process and one front-end in a uvicorn thread (tests, tools); stops both on exit."""
    core, addresses = start_engine_core(engine_factory, log_level=logging.WARNING)
    client = EngineClient(addresses, 0, core.pid, stream_interval=stream_interval)
    app = build_app(client, served_model_name, api_key, startup_timeout)
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
        yield LocalServer(f"http://{host}:{port}", app, core)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        shutdown_engine_core(core, addresses)


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` on /v1/* (default: $SPECSERVE_API_KEY if set)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model id(s) clients may send (default: the engine's model name; 'default' always works)")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="waiting-queue size; requests beyond it get 503 + Retry-After (default: engine's)")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP front-end processes sharing the port (tokenize, detokenize, stream); one engine core")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="tokens a stream gathers before it sends a chunk; a chunk always carries every token "
                        "gained since the last one (default %(default)s)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds requests in flight may run on before they are aborted "
                        "(default %(default)s)")
    g.add_argument("--enable-access-log", action="store_true", help="log every HTTP request (off: it costs at load)")
    g.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_KEEP_ALIVE_S,
                   help="seconds an idle HTTP/1.1 connection stays open (default %(default)s; keep it longer "
                        "than clients' pool expiry, or a reused connection may be reset)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


def check_serve_args(args: argparse.Namespace) -> None:
    for name, low in (("max_waiting", 1), ("timeout_keep_alive", 1), ("api_server_count", 1),
                      ("stream_interval", 1), ("shutdown_timeout", 0)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def _default_head_available() -> bool:
    """The default model is served with its shipped EAGLE-3 head when that head exists."""
    try:
        from specserve.speculative.drafter import default_draft_path

        default_draft_path()
        return True
    except (ImportError, FileNotFoundError) as e:
        log.warning("serving without speculation by default: %s", e)
        return False


def build_engine(config: Any) -> Any:
    """The engine-core process's engine (module level: picklable for spawn)."""
    from specserve.engine.engine import LLMEngine

    return LLMEngine(config)


def main(args: argparse.Namespace) -> None:
    """`specserve serve`."""
    import functools

    from specserve.config import replace
    from specserve.engine.args import engine_config_from_args

    check_serve_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    default_spec = (getattr(args, "model", None) is None and getattr(args, "speculative_algorithm", None) is None
                    and _default_head_available())
    config = engine_config_from_args(args, default_speculative=default_spec)
    if args.max_waiting is not None:
        config = replace(config, max_waiting_requests=args.max_waiting)
    sys.exit(run_server(args, functools.partial(build_engine, config)))


def run_server(args: argparse.Namespace, engine_factory: Callable[[], Any]) -> int:
    """Supervise an engine core and ``args.api_server_count`` front-ends until they stop; the exit code.

    SIGTERM/SIGINT: the front-ends drain (shutdown_timeout), then the core stops: 0. The core dies:
    the front-ends answer 503, exit non-zero, and so does this."""
    check_serve_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = _bind(args.host, args.port)
    n = args.api_server_count
    core, addresses = start_engine_core(engine_factory, n)
    metrics_dir = None
    if n > 1:  # the front-ends' metrics go to files that each one's /metrics sums
        metrics_dir = tempfile.mkdtemp(prefix="specserve-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    api_key = args.api_key if args.api_key is not None else os.environ.get("SPECSERVE_API_KEY") or None
    opts = FrontendOptions(args.served_model_name, api_key, args.stream_interval, args.shutdown_timeout,
                           args.enable_access_log, args.timeout_keep_alive, args.uvicorn_log_level)
    fronts = [_spawn().Process(target=run_frontend, args=(opts, addresses, i, core.pid, sock),
                               name=f"specserve-api-{i}") for i in range(n)]
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
    log.info("serving on http://%s:%d: engine core pid %d, %d front-end(s)", args.host, args.port, core.pid, n)
    failed = False
    while any(f.is_alive() for f in fronts):
        multiprocessing.connection.wait([f.sentinel for f in fronts], timeout=1.0)
        if any(f.exitcode not in (None, 0) for f in fronts) and not failed:
            failed = True  # one front-end failed (the core died, or it did): stop the others
            for f in fronts:
                if f.is_alive():
                    os.kill(f.pid, signal.SIGTERM)
    core_died = core.exitcode is not None
    shutdown_engine_core(core, addresses)
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


def run_frontend(opts: FrontendOptions, addresses: CoreAddresses, index: int, core_pid: int,
                 sock: socket.socket) -> None:
    """Entry point of a front-end process: serve until drained (exit 0) or the core dies (exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prometheus_client.disable_created_metrics()  # no *_created series next to every counter
    client = EngineClient(addresses, index, core_pid, stream_interval=opts.stream_interval)
    app = build_app(client, opts.served_model_name, opts.api_key)
    srv: _Server = app.state.server
    config = uvicorn.Config(app, log_level=opts.log_level, access_log=opts.enable_access_log,
                            timeout_graceful_shutdown=GRACEFUL_CLOSE_S, timeout_keep_alive=opts.timeout_keep_alive)
    server = _DrainingServer(config, srv, opts.shutdown_timeout)

    def on_dead() -> None:  # answer what is in flight (503), then go: the supervisor stops the rest
        server.should_exit = True

    client.on_dead = on_dead
    server.run(sockets=[sock])
    sys.exit(1 if client.error is not None else 0)


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM/SIGINT drains the front-end (_Server.drain) before it exits."""

    def __init__(self, config: uvicorn.Config, srv: _Server, timeout: float) -> None:
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
