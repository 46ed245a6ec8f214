"""OpenAI-compatible HTTP server (FastAPI + uvicorn) around one engine.

    app = build_app(engine)            # any object with the LLMEngine interface
    with serve_in_thread(app) as url:  # or main(args) for `specserve serve`
        ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.heap import freeze_startup_heap
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.server import protocol as P
from specserve.server.async_engine import AsyncEngine, EngineDeadError, RequestStream, is_queue_full
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
    """State shared by the route handlers of one app."""

    def __init__(self, engine: Any, served_model_names: list[str], api_key: str | None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_names = served_model_names
        self.api_key = api_key
        self.metrics = ServerMetrics(served_model_names[0])
        self.aengine: AsyncEngine | None = None
        self.started = int(time.time())

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, requested: str | None) -> None:
        if requested is None or requested == "default" or requested in self.model_names:
            return
        raise ApiError(
            404, f"The model `{requested}` does not exist. Served: {', '.join(self.model_names)}",
            "NotFoundError", "model_not_found", "model",
        )

    async def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     arrival: float) -> RequestStream:
        assert self.aengine is not None
        try:
            return await self.aengine.add_request(request_id, prompt, params, arrival)
        except EngineDeadError as e:
            raise ApiError(503, f"The engine is not running: {e}", "ServiceUnavailableError") from e
        except ValueError as e:  # the engine's verdict on the input (lengths, empty prompt, ...)
            raise ApiError(400, str(e), "BadRequestError", "invalid_request") from e
        except RuntimeError as e:
            if is_queue_full(e):
                raise ApiError(
                    503, f"Server overloaded: the waiting queue is full ({e}). Retry later.",
                    "ServiceUnavailableError", "queue_full",
                    headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
                ) from e
            raise


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(stream: RequestStream, request: Request) -> RequestOutput | None:
    """Last output of a non-streaming request, or None if the client went away first (aborted)."""

    async def consume() -> RequestOutput | None:
        final = None
        async for out in stream:
            final = out
        return final

    task = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        return None
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        stream.close()


def _stats_dict(stats: Any) -> dict[str, Any]:
    """EngineStats as JSON-ready fields (not dataclasses.asdict: it rebuilds a Counter from pairs)."""
    if not dataclasses.is_dataclass(stats):
        return {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(stats):
        value = getattr(stats, f.name)
        if isinstance(value, dict):
            value = {str(k): v for k, v in sorted(value.items())}
        elif isinstance(value, (list, tuple)):
            value = list(value)
        out[f.name] = value
    return out


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(engine: Any, served_model_name: str | list[str] | None = None, api_key: str | None = None) -> FastAPI:
    """The FastAPI app. The engine thread starts with the app (lifespan) and stops with it."""
    if isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name or []) or [engine.model_name]
    srv = _Server(engine, names, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        srv.aengine = AsyncEngine(engine, observer=srv.metrics)
        srv.aengine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(srv.aengine.shutdown)

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
        if srv.aengine is not None and srv.aengine.is_alive:
            return JSONResponse({"status": "ok"})
        return _error(503, f"engine is not running: {srv.aengine.error if srv.aengine else None!r}",
                      "ServiceUnavailableError")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [
            {"id": name, "object": "model", "created": srv.started, "owned_by": "specserve",
             "root": getattr(engine.config, "model", None) or name, "max_model_len": engine.max_model_len}
            for name in srv.model_names
        ]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        assert srv.aengine is not None
        stats = srv.aengine.stats
        state = _stats_dict(stats)
        accept = avg_accept_length(stats)
        if accept is not None:  # absent without speculation, as SGLang does
            state["avg_spec_accept_length"] = accept
        state["last_gen_throughput"] = srv.metrics.last_gen_throughput()
        cfg = engine.config
        spec = getattr(cfg, "speculative", None)
        return jsonable_encoder({
            "served_model_name": srv.model_name,
            "model_path": getattr(cfg, "model", None),
            "max_model_len": engine.max_model_len,
            "speculative_algorithm": getattr(spec, "algorithm", None),
            "engine_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None,
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
        stream = await srv.submit(request_id, list(prompt_ids), params, arrival)

        if body.stream:
            gen = _chat_stream(srv, stream, request_id, created, model, params, top_n, body.include_usage)
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS,
                                     background=BackgroundTask(stream.close))
        final = await _collect(stream, request)
        if final is None:
            return Response(status_code=499)  # client closed the request; nobody reads this
        c = final.outputs[0]
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": (P.chat_logprobs(srv.tokenizer, c.token_ids, c.logprobs, top_n)
                         if params.logprobs is not None and c.logprobs is not None else None),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": P.usage_dict(final),
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
        stream = await srv.submit(request_id, prompt, params, arrival)
        echo_text = "" if not body.echo else (prompt if isinstance(prompt, str) else srv.tokenizer.decode(prompt))

        if body.stream:
            gen = _completion_stream(srv, stream, request_id, created, model, params, top_n,
                                     body.include_usage, echo_text)
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS,
                                     background=BackgroundTask(stream.close))
        final = await _collect(stream, request)
        if final is None:
            return Response(status_code=499)
        c = final.outputs[0]
        logprobs = None
        if params.logprobs is not None and c.logprobs is not None:
            logprobs = P.completion_logprobs(srv.tokenizer, c.token_ids, c.logprobs, top_n, len(echo_text))
        choice = {"index": 0, "text": echo_text + c.text, "logprobs": logprobs,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": P.usage_dict(final),
        })

    return app


# ---------------------------------------------------------------- SSE generators


async def _chat_stream(srv: _Server, stream: RequestStream, request_id: str, created: int, model: str,
                       params: SamplingParams, top_n: int, include_usage: bool) -> AsyncIterator[str]:
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
        sent = 0
        final = None
        first = True
        async for out in stream:
            if first:  # sent with the first output, so a client's time-to-first-chunk is a real TTFT
                yield _sse(chunk({"role": "assistant", "content": ""}))
                first = False
            c = out.outputs[0]
            n = len(out.new_token_ids)
            logprobs = None
            if params.logprobs is not None and c.logprobs is not None and n:
                logprobs = P.chat_logprobs(srv.tokenizer, c.token_ids[sent:sent + n], c.logprobs[sent:sent + n], top_n)
            sent += n
            delta = {"content": out.new_text} if out.new_text else {}
            if out.finished:
                final = out
                yield _sse(chunk(delta, c.finish_reason, logprobs, c.stop_reason))
            elif delta or logprobs:
                yield _sse(chunk(delta, None, logprobs))
        if include_usage and final is not None:
            yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": P.usage_dict(final)})
    except EngineDeadError as e:
        yield _sse(P.error_body(f"The engine stopped: {e}", "ServiceUnavailableError", 503))
    except Exception as e:
        log.exception("stream %s failed", request_id)
        yield _sse(P.error_body(f"Internal server error: {type(e).__name__}: {e}", "InternalServerError", 500))
    finally:
        stream.close()  # aborts (frees KV blocks) when the client went away mid-stream
    yield "data: [DONE]\n\n"


async def _completion_stream(srv: _Server, stream: RequestStream, request_id: str, created: int, model: str,
                             params: SamplingParams, top_n: int, include_usage: bool,
                             echo_text: str) -> AsyncIterator[str]:
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
        sent = 0
        final = None
        async for out in stream:
            c = out.outputs[0]
            n = len(out.new_token_ids)
            logprobs = None
            if params.logprobs is not None and c.logprobs is not None and n:
                logprobs = P.completion_logprobs(srv.tokenizer, c.token_ids[sent:sent + n],
                                                 c.logprobs[sent:sent + n], top_n, offset)
            sent += n
            offset += len(out.new_text)
            if out.finished:
                final = out
                yield _sse(chunk(out.new_text, c.finish_reason, logprobs, c.stop_reason))
            elif out.new_text or logprobs:
                yield _sse(chunk(out.new_text, None, logprobs))
        if include_usage and final is not None:
            yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": P.usage_dict(final)})
    except EngineDeadError as e:
        yield _sse(P.error_body(f"The engine stopped: {e}", "ServiceUnavailableError", 503))
    except Exception as e:
        log.exception("stream %s failed", request_id)
        yield _sse(P.error_body(f"Internal server error: {type(e).__name__}: {e}", "InternalServerError", 500))
    finally:
        stream.close()
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- running it


# Longer than the idle expiry of common HTTP client pools (httpx and the openai client: 5 s). With equal
# timeouts the server may close an idle connection just as the client reuses it: connection reset.
DEFAULT_KEEP_ALIVE_S = 30


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 60.0,
                    timeout_keep_alive: int = DEFAULT_KEEP_ALIVE_S) -> Iterator[str]:
    """Run uvicorn in a background thread; yields the base URL; always shuts down on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                            timeout_keep_alive=timeout_keep_alive))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="specserve-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


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
    g.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_KEEP_ALIVE_S,
                   help="seconds an idle HTTP/1.1 connection stays open (default %(default)s; keep it longer "
                        "than clients' pool expiry, or a reused connection may be reset)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


def _default_head_available() -> bool:
    """The default model is served with its shipped EAGLE-3 head when that head exists."""
    try:
        from specserve.speculative.drafter import default_draft_path

        default_draft_path()
        return True
    except (ImportError, FileNotFoundError) as e:
        log.warning("serving without speculation by default: %s", e)
        return False


def main(args: argparse.Namespace) -> None:
    import uvicorn

    from specserve.config import replace
    from specserve.engine.args import engine_config_from_args
    from specserve.engine.engine import LLMEngine

    if args.max_waiting is not None and args.max_waiting < 1:
        raise SystemExit(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if args.timeout_keep_alive < 1:
        raise SystemExit(f"--timeout-keep-alive must be >= 1, got {args.timeout_keep_alive}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    default_spec = (getattr(args, "model", None) is None and getattr(args, "speculative_algorithm", None) is None
                    and _default_head_available())
    config = engine_config_from_args(args, default_speculative=default_spec)
    if args.max_waiting is not None:
        config = replace(config, max_waiting_requests=args.max_waiting)
    prometheus_client.disable_created_metrics()  # no *_created series next to every counter
    engine = LLMEngine(config)
    api_key = args.api_key if args.api_key is not None else os.environ.get("SPECSERVE_API_KEY") or None
    app = build_app(engine, served_model_name=args.served_model_name, api_key=api_key)
    frozen = freeze_startup_heap()  # the engine and app live as long as the server
    log.info("moved %d start-up objects out of the garbage collector's reach", frozen)
    log.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5,
                timeout_keep_alive=args.timeout_keep_alive)


if __name__ == "__main__":
    from specserve.engine.args import add_engine_args

    _parser = argparse.ArgumentParser(description="specserve OpenAI-compatible server")
    add_engine_args(_parser)
    add_serve_args(_parser)
    main(_parser.parse_args())
